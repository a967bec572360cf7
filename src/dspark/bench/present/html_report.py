"""A self-contained HTML report: one ``index.html`` that works alone (figures embedded as
base64) with the PNGs also written next to it, for slides and READMEs.

Everything in it is computed from the results given: figures, tables, anomalies, provenance.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path

from dspark.bench.analyse.anomalies import devices
from dspark.bench.present.formatting import (
    BREAKDOWN_COLUMNS,
    BREAKDOWN_NOTE,
    MEMORY_COLUMNS_NOTE,
    PEER_COLUMNS,
    PEER_NOTE,
    PEER_TEXT_COLUMNS,
    RESULT_COLUMNS,
    TEXT_COLUMNS,
    breakdown_rows,
    peer_rows,
    result_cells,
)
from dspark.bench.result import BenchResult

__all__ = ["write_html_report"]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f0f0f0; } td.text { text-align: left; }
li.anomaly { margin: 0.4em 0; } .kind { font-weight: bold; color: #c0392b; }
figure { margin: 1.5em 0; } img { max-width: 100%; }
"""


def _cell(value: object, *, text: bool = False) -> str:
    css = ' class="text"' if text else ""
    return f"<td{css}>{html.escape(str(value))}</td>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(f"<tr>{''.join(row)}</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _results_table(results: Sequence[BenchResult]) -> str:
    rows = [[_cell(value, text=column in TEXT_COLUMNS)
             for column, value in zip(RESULT_COLUMNS, result_cells(r), strict=True)]
            for r in results]
    return _table(RESULT_COLUMNS, rows)


def _breakdown_section(results: Sequence[BenchResult]) -> str:
    rows = [[_cell(value, text=column in ("configuration", "host"))
             for column, value in zip(BREAKDOWN_COLUMNS, row, strict=True)]
            for r in results for row in breakdown_rows(r)]
    if not rows:
        return ""
    return (f"<h2>Step breakdown per rank</h2>{_table(BREAKDOWN_COLUMNS, rows)}"
            f"<p class='note'>{html.escape(BREAKDOWN_NOTE)}</p>")


def _peer_section(results: Sequence[BenchResult]) -> str:
    rows = [[_cell(value, text=column in PEER_TEXT_COLUMNS)
             for column, value in zip(PEER_COLUMNS, row, strict=True)]
            for row in peer_rows(results)]
    if not rows:
        return ""
    return (f"<h2>DSpark beside its peers</h2>{_table(PEER_COLUMNS, rows)}"
            f"<p class='note'>{html.escape(PEER_NOTE)}</p>")


def _row_label(r: BenchResult) -> str:
    return f"{r.workload}, {devices(r.num_devices)}, {r.strategy}, {r.precision}, batch {r.batch_placement}"


def _anomaly_list(results: Sequence[BenchResult]) -> str:
    items = [f'<li class="anomaly"><span class="kind">{html.escape(str(a.get("kind")))}</span> '
             f"[{html.escape(_row_label(r))}]"
             f" {html.escape(str(a.get('message', '')))}</li>"
             for r in results for a in r.anomalies]
    return f"<ul>{''.join(items)}</ul>" if items else "<p>No anomalies.</p>"


def _provenance_table(results: Sequence[BenchResult]) -> str:
    fields = ("git_commit", "git_dirty", "dspark_version", "torch_version", "python_version",
              "host", "device_model", "backend")
    groups: dict[tuple[object, ...], list[BenchResult]] = {}
    for r in results:
        groups.setdefault(tuple(getattr(r, name) for name in fields), []).append(r)
    rows = []
    for values, members in groups.items():
        run_ids = ", ".join(dict.fromkeys(r.run_id for r in members))
        stamps = sorted(r.timestamp for r in members)
        rows.append([_cell(v, text=True) for v in values]
                    + [_cell(run_ids, text=True), _cell(f"{stamps[0]} .. {stamps[-1]}", text=True),
                       _cell(len(members))])
    return _table(["commit", "dirty", "DSpark", "PyTorch", "Python", "host", "device", "backend",
                   "runs", "time (UTC)", "results"], rows)


def write_html_report(results: Sequence[BenchResult], out_dir: str | Path, *,
                      title: str = "DSpark benchmark report") -> Path:
    """Write ``out_dir/index.html`` (figures embedded) and the figures as PNGs beside it.

    Returns the path of ``index.html``. Pass annotated results (speedup, anomalies).

    Example::

        write_html_report(annotate(ledger.resolve("latest")), "bench-report")
    """
    if not results:
        raise ValueError("results=[] is empty: there is nothing to report; run `dspark bench` "
                         "first or pick a ref that holds results")
    # matplotlib is imported only here: the terminal commands should not pay for it.
    from dspark.bench.present.plots import report_figures

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures_html = []
    for item in report_figures(results):
        png_path = out / f"{item.name}.png"
        item.figure.savefig(png_path, format="png", dpi=100)
        encoded = base64.b64encode(png_path.read_bytes()).decode("ascii")
        figures_html.append(
            f'<figure><img alt="{html.escape(item.caption)}" src="data:image/png;base64,{encoded}">'
            f'<figcaption>{html.escape(item.caption)} (<a href="{png_path.name}">'
            f"{png_path.name}</a>)</figcaption></figure>")
    runs = ", ".join(dict.fromkeys(r.run_id for r in results))
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>{len(results)} results from runs {html.escape(runs)}.</p>"
            f"<h2>Figures</h2>{''.join(figures_html)}"
            f"<h2>Results</h2>{_results_table(results)}"
            f"<p class='note'>{html.escape(MEMORY_COLUMNS_NOTE)}</p>"
            f"{_peer_section(results)}"
            f"{_breakdown_section(results)}"
            f"<h2>Anomalies</h2>{_anomaly_list(results)}"
            f"<h2>Provenance</h2>{_provenance_table(results)}</body></html>\n")
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index
