"""A ledger as a text file: every row with its hashes, one JSON object a line (``.jsonl``).

[Note: kept rows]
What ``benchmarks/results/<artifact>/`` keeps of a ``dspark bench`` run is its ledger's rows, not
the SQLite file: ``dspark bench export --rows ledger.jsonl`` writes a header line (the format, the
schema version, any seal, see [Note: no silent seal]) and then each measurement row as it is stored,
its ``id``, every content column (``measurement_json`` as the exact text its hash covers),
``prev_hash`` and ``row_hash``. A line a row keeps the file small to diff and review in git, and
nothing is re-encoded, so the hashes verify as they did in SQLite. ``Ledger("ledger.jsonl")`` reads
such a file back (read-only, in memory), so every reading command of ``dspark bench`` works on a
kept artifact: ``verify --head H``, ``list``, ``export --json``. The file is bounded
(:data:`MAX_ROWS_FILE_BYTES`): a crafted one cannot make a reader hold more than that.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from dspark.bench.ledger.schema import CONTENT_COLUMNS, SCHEMA_VERSION, create_schema

__all__ = ["MAX_ROWS_FILE_BYTES", "ROWS_FORMAT", "ROWS_SUFFIX", "load_rows", "write_rows"]

ROWS_FORMAT = "dspark-ledger-rows"
ROWS_SUFFIX = ".jsonl"
MAX_ROWS_FILE_BYTES = 256 * 2**20
"""The largest rows file read: far above any suite's (a row is a few kB), far below a machine's memory."""

_ROW_KEYS = ("id", *CONTENT_COLUMNS, "prev_hash", "row_hash")
_SEAL_KEYS = ("sealed_at", "from_version", "rows", "head")


def write_rows(conn: sqlite3.Connection, path: Path) -> int:
    """Write every row of the ledger on ``conn`` (and its seals) to ``path``; returns the rows written.

    Example::

        write_rows(ledger_connection, Path("benchmarks/results/x/ledger.jsonl"))
    """
    seals = [dict(zip(_SEAL_KEYS, row, strict=True)) for row in conn.execute(
        f"SELECT {', '.join(_SEAL_KEYS)} FROM seals ORDER BY id")]
    header = {"format": ROWS_FORMAT, "schema_version": SCHEMA_VERSION, "seals": seals}
    count = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        out.write(json.dumps(header) + "\n")
        for row in conn.execute(f"SELECT {', '.join(_ROW_KEYS)} FROM measurements ORDER BY id"):
            out.write(json.dumps(dict(zip(_ROW_KEYS, row, strict=True))) + "\n")
            count += 1
    return count


def _parse(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


def _dict_of(value: Any, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected an object, got a {type(value).__name__}")
    missing, unknown = [k for k in keys if k not in value], sorted(set(value) - set(keys))
    if missing or unknown:
        raise ValueError(f"{where}: the row lacks key(s) {missing} and has unknown key(s) {unknown}: "
                         "the file was altered (every row keeps its prev_hash and row_hash)")
    return value


def load_rows(conn: sqlite3.Connection, path: Path) -> None:
    """Create a ledger on the empty ``conn`` (autocommit mode) holding the rows of ``path`` exactly as
    written, ids and hashes included (verify them with :meth:`Ledger.verify`). A file that is not a
    rows file, too large, or malformed is a ``ValueError`` naming it and the line.

    Example::

        load_rows(sqlite3.connect(":memory:", isolation_level=None), Path("ledger.jsonl"))
    """
    size = path.stat().st_size
    if size > MAX_ROWS_FILE_BYTES:
        raise ValueError(f"{str(path)!r} is {size} bytes, above the {MAX_ROWS_FILE_BYTES} a ledger "
                         "rows file may hold: not a file `dspark bench export --rows` wrote")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    header = _parse(lines[0], f"{path}:1") if lines else None
    if not isinstance(header, dict) or header.get("format") != ROWS_FORMAT:
        raise ValueError(f"{str(path)!r} is not a ledger rows file (its first line is not "
                         f"{{\"format\": {ROWS_FORMAT!r}, ...}}; `dspark bench export --rows` writes one)")
    if header.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}:1: schema_version {header.get('schema_version')!r}, this DSpark "
                         f"reads {SCHEMA_VERSION}")
    seals = header.get("seals")
    if not isinstance(seals, list):
        raise ValueError(f"{path}:1: \"seals\" must be a list, got {seals!r:.60}")
    create_schema(conn)
    conn.execute("BEGIN")
    try:
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                     (SCHEMA_VERSION, f"read from {path.name}"))
        for seal in seals:
            found = _dict_of(seal, _SEAL_KEYS, f"{path}:1: a seal")
            conn.execute(f"INSERT INTO seals ({', '.join(_SEAL_KEYS)}) VALUES (?, ?, ?, ?)",
                         tuple(found[k] for k in _SEAL_KEYS))
        insert = (f"INSERT INTO measurements ({', '.join(_ROW_KEYS)}) "
                  f"VALUES ({', '.join('?' for _ in _ROW_KEYS)})")
        for number, line in enumerate(lines[1:], 2):
            row = _dict_of(_parse(line, f"{path}:{number}"), _ROW_KEYS, f"{path}:{number}")
            try:
                conn.execute(insert, tuple(row[k] for k in _ROW_KEYS))
            except sqlite3.Error as exc:
                raise ValueError(f"{path}:{number}: the row cannot be read back ({exc}): the file was "
                                 "altered") from None
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
