"""Every table in the docs renders as one: a run of ``|`` lines starts with its header and the
``|---|`` row (a blank line inside a table ends it, and the rows after it render as plain text)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SEPARATOR = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+\s*$")


def headless_tables(text: str) -> list[int]:
    """The line numbers (1-based) of table runs whose second line is not a ``|---|`` row."""
    lines = text.splitlines()
    found, fenced = [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|") or (i > 0 and lines[i - 1].startswith("|")):
            continue
        if i + 1 >= len(lines) or not _SEPARATOR.match(lines[i + 1]):
            found.append(i + 1)
    return found


def test_every_docs_table_has_its_header_row() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = {page.name: rows for page in pages if (rows := headless_tables(page.read_text()))}
    assert broken == {}, f"table rows without a header (a blank line inside a table?): {broken}"


def test_a_blank_line_inside_a_table_is_caught() -> None:
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert headless_tables(table) == []
    assert headless_tables(table + "\n| 3 | 4 |\n") == [5]
