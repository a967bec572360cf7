"""Table artifacts: a benchmark's published table as data, rendered into docs/figures.md.

[Note: table artifacts]
Not every measurement is a row of the lab's ledger: a launcher's start-up time, the resident memory
of three ways to load weights, a save's stall. Such a benchmark writes its table with
:func:`write_table` (``--out DIR`` gives ``DIR/table.json``: ``{"columns": [...], "rows": [[cell,
...], ...], "caption": "..."}``, every cell already formatted as it is published), and the kept
artifact's ``artifact.json`` lists it under ``"tables"``. :mod:`dspark.bench.figures` renders it as
it is, so the number in docs/figures.md is the string the benchmark wrote, and the test that looks
for hand-edited numbers knows every cell. ``python -m dspark.bench.record`` makes the whole
artifact directory from one command (see [Note: figures from artifacts]).

Example::

    write_table(out_dir, columns=["launcher", "first output s", "exit s"],
                rows=[["dspark run", 1.23, 2.5]], caption="median of 5, interleaved")
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Table", "load_table", "markdown_table", "write_table"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Table:
    """One published table: its header, its rows of formatted cells and an optional caption."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    caption: str = ""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def write_table(out_dir: str | Path, *, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                caption: str = "", name: str = "table.json") -> Path:
    """Write ``out_dir/name`` (creating ``out_dir``); floats are written with two decimals, ``None``
    as ``-``, anything else with ``str``. A row of the wrong width is a ``ValueError``.

    Example::

        write_table("out", columns=["mode", "stall ms"], rows=[["sync", 12.5]])   # out/table.json
    """
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(columns)} columns "
                             f"{list(columns)!r}")
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["{", f'  "columns": {json.dumps(list(columns))},']
    if caption:
        lines.append(f'  "caption": {json.dumps(caption)},')
    body = ",\n".join("    " + json.dumps([_cell(v) for v in row]) for row in rows)
    lines += ['  "rows": [' + ("\n" + body + "\n  ]" if rows else "]"), "}"]
    path.write_text("\n".join(lines) + "\n")   # a row a line: a diff shows which figure moved
    return path


def load_table(path: Path) -> Table:
    """The table in ``path``; anything but ``{"columns": [str, ...], "rows": [[str, ...], ...]}``
    with rows as wide as the columns is a ``ValueError`` naming the file."""
    data = json.loads(Path(path).read_text())
    columns, rows = (data.get("columns"), data.get("rows")) if isinstance(data, dict) else (None, None)
    if (not isinstance(columns, list) or not isinstance(rows, list)
            or not all(isinstance(r, list) and len(r) == len(columns) for r in rows)):
        raise ValueError(f"{path}: not a table ({{'columns': [...], 'rows': [[cell, ...], ...]}} "
                         f"with every row as wide as the columns)")
    return Table(columns=tuple(str(c) for c in columns),
                 rows=tuple(tuple(str(c) for c in r) for r in rows),
                 caption=str(data.get("caption", "")))


def markdown_table(table: Table) -> list[str]:
    """``table`` as Markdown lines: the caption (if any), a blank line, the header and the rows."""
    out = [table.caption, ""] if table.caption else []
    out += ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in table.rows]
    return out
