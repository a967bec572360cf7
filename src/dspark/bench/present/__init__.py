"""Showing results: number formats, the console tables (rich), the HTML report and its figures
(matplotlib, imported only where a figure is drawn)."""
