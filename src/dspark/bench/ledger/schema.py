"""The ledger's table layout, its append-only triggers, and the migrations between layouts.

[Note: append-only for real]
The triggers abort any UPDATE or DELETE, and any INSERT whose row id or measurement id is already
in the table. The last one is what makes ``INSERT OR REPLACE`` fail: SQLite resolves that conflict
by deleting the old row without firing delete triggers (unless recursive triggers are on), so a
delete trigger alone never sees it. A ``BEFORE INSERT`` trigger runs before the conflict is
resolved. (Dropping a table or a trigger is schema surgery no trigger can forbid; DSpark never
does it.)

Schema history:
1. ``results``: one row per configuration per run, with the speedup and anomalies of the day
   frozen into the JSON, and only the median, p10 and p90 of the steps.
2. ``measurements``: one row per launch (a round), raw: every step of every rank, the load of each
   core, the bytes held. Analysis is computed when read. A schema-1 file is migrated in place: each
   old row is copied as a one-round measurement without samples (its frozen analysis is dropped
   and recomputed), and the old table stays as it was, now refusing ``INSERT OR REPLACE`` too.

Within schema 2, a measurement's JSON gains keys without a layout change: ``hosts_by_rank``,
``profiled``, ``phase_ms_by_rank`` (``dspark bench --profile``), ``audit_by_rank``,
``optimizer_kernel`` and ``micro_batches``. A row written before them reads back without them (empty
breakdown, no audit, no kernel, one pass a step); an older DSpark reading a newer row drops the keys
it does not know. No version bump, so neither side refuses the other's file: the raw figures of a
launch belong in its one ``measurement_json``, and a column or side table for them would only repeat
it.
3. ``prev_hash`` and ``row_hash`` on every measurement: a hash chain (see [Note: hash chain] in
   :mod:`dspark.bench.ledger.chain`). The schema-1 ``results`` table, kept by the migration to 2,
   is never read.
4. ``seals``: one row each time DSpark chained rows that had no hash (see [Note: no silent seal]).
   A schema-3 file gains the empty table on open; nothing in it is rewritten.

[Note: no silent seal]
A file of schema 1 or 2 has no hash chain, and neither has a chained file whose hash columns were
dropped and whose version was set back: from the file alone the two cannot be told apart. So no
such file is chained on open (that would launder whatever was edited in it): it is refused, with
the one command that chains it, ``dspark bench verify --seal``. That command chains the rows as
they are now, in insertion order, and records the seal (when, from which version, how many rows,
the head it gave) in ``seals``, which every ``dspark bench verify`` reports from then on. A kept
artifact's rows never carry a seal (``make figures`` refuses one), and a head
kept from before a re-seal catches any row that changed (``dspark bench verify --head``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.bench.ledger.chain import GENESIS, row_hash

if TYPE_CHECKING:
    from dspark.bench.ledger.measurement import Measurement

__all__ = ["CONTENT_COLUMNS", "KEY_COLUMNS", "SCHEMA_VERSION", "TRIGGERS", "LedgerUnsealed",
           "create_schema", "insert_measurement_sql", "measurement_row", "migrate", "missing_triggers",
           "utc_timestamp"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 4
"""Bump with a migration in ``_MIGRATIONS`` when the table layout changes."""


class LedgerUnsealed(ValueError):
    """A ledger without a hash chain (schema 1 or 2, or one whose chain was dropped): refused until
    it is sealed explicitly (see [Note: no silent seal])."""

KEY_COLUMNS = ("workload", "num_devices", "strategy", "precision", "batch_placement",
               "global_batch")


def _no_replace(table: str, *unique: str) -> str:
    exists = " OR ".join(f"{column} = NEW.{column}" for column in unique)
    message = (f"the DSpark ledger is append-only: a row with this id is already in {table}; "
               "INSERT OR REPLACE would overwrite it")
    return f"""
CREATE TRIGGER {table}_no_replace BEFORE INSERT ON {table}
WHEN EXISTS (SELECT 1 FROM {table} WHERE {exists})
BEGIN SELECT RAISE(ABORT, '{message}'); END;
"""


def _no_update(table: str) -> str:
    return f"""
CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table}
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: {table} are never updated'); END;
"""


def _append_only(table: str, *unique: str) -> str:
    return _no_update(table) + f"""
CREATE TRIGGER {table}_no_delete BEFORE DELETE ON {table}
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: {table} are never deleted'); END;
""" + _no_replace(table, *unique)


_SCHEMA_VERSION_TABLE = """
CREATE TABLE schema_version (
    version INTEGER NOT NULL,
    applied_at TEXT NOT NULL
);
CREATE TRIGGER schema_version_no_update BEFORE UPDATE ON schema_version
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: schema versions are never updated'); END;
CREATE TRIGGER schema_version_no_delete BEFORE DELETE ON schema_version
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: schema versions are never deleted'); END;
"""

_MEASUREMENTS = """
CREATE TABLE measurements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    measurement_id TEXT NOT NULL UNIQUE,  -- <run id>/<config hash>/r<round>
    result_id TEXT NOT NULL,              -- <run id>/<config hash>
    run_id TEXT NOT NULL,
    round_index INTEGER NOT NULL,
    timestamp TEXT NOT NULL,              -- UTC, normalised (see utc_timestamp)
    git_commit TEXT NOT NULL,
    git_dirty INTEGER NOT NULL,
    host TEXT NOT NULL,
    workload TEXT NOT NULL,
    num_devices INTEGER NOT NULL,
    strategy TEXT NOT NULL,
    precision TEXT NOT NULL,
    batch_placement TEXT NOT NULL,
    global_batch INTEGER NOT NULL,
    config_hash TEXT NOT NULL,
    measurement_json TEXT NOT NULL,
    prev_hash TEXT,                       -- the previous row's row_hash (see ledger_chain)
    row_hash TEXT                         -- sha256 of prev_hash and this row's content
);
CREATE INDEX measurements_by_key ON measurements (workload, num_devices, strategy, precision,
                                                  batch_placement, global_batch, timestamp);
CREATE INDEX measurements_by_run ON measurements (run_id);
CREATE INDEX measurements_by_result ON measurements (result_id);
CREATE INDEX measurements_by_commit ON measurements (git_commit);
""" + _append_only("measurements", "id", "measurement_id")


CONTENT_COLUMNS = ("measurement_id", "result_id", "run_id", "round_index", "timestamp",
                   "git_commit", "git_dirty", "host", *KEY_COLUMNS, "config_hash",
                   "measurement_json")
"""What a row's hash covers: every column but ``id`` and the two hashes."""


def insert_measurement_sql() -> str:
    """The one INSERT the ledger writes measurements with (the 16 :data:`CONTENT_COLUMNS`, then
    ``prev_hash`` and ``row_hash``; ``id`` left to SQLite)."""
    columns = (*CONTENT_COLUMNS, "prev_hash", "row_hash")
    return (f"INSERT INTO measurements ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' for _ in columns)})")


def utc_timestamp(timestamp: str, *, what: str = "result") -> str:
    """``timestamp`` (ISO 8601; naive means UTC) as UTC with microseconds, so strings sort in time.

    Example::

        utc_timestamp("2026-11-30T07:16:56+02:00")   # "2026-11-30T05:16:56.000000+00:00"
    """
    try:
        moment = datetime.fromisoformat(timestamp)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: timestamp={timestamp!r} is not ISO 8601 "
                         "(e.g. '2026-11-30T05:16:56+00:00')") from None
    if moment.tzinfo is None:  # the schema says UTC; a naive time is read as such
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).isoformat(timespec="microseconds")


def _execute_script(conn: sqlite3.Connection, script: str) -> None:
    # executescript() would commit the open transaction first; one statement at a time stays in it.
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            conn.execute(pending)
            pending = ""
    if pending.strip():
        raise AssertionError(f"incomplete SQL statement in a ledger migration: {pending!r}")


_SEALS = """
CREATE TABLE seals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    sealed_at TEXT NOT NULL,              -- UTC
    from_version INTEGER NOT NULL,        -- the unchained schema the rows were in
    rows INTEGER NOT NULL,                -- rows chained (ids 1..rows)
    head TEXT NOT NULL                    -- the chain's head right after the seal
);
""" + _append_only("seals", "id")

TRIGGERS = ("schema_version_no_update", "schema_version_no_delete", "measurements_no_update",
            "measurements_no_delete", "measurements_no_replace", "seals_no_update", "seals_no_delete",
            "seals_no_replace")
"""The triggers that keep a ledger append-only (see [Note: append-only for real])."""

_COLUMNS = {"schema_version": ("version", "applied_at"),
            "measurements": ("id", *CONTENT_COLUMNS, "prev_hash", "row_hash"),
            "seals": ("id", "sealed_at", "from_version", "rows", "head")}


def create_schema(conn: sqlite3.Connection) -> None:
    """Create an empty ledger's tables and triggers on ``conn`` (no version row).

    Example::

        create_schema(sqlite3.connect(":memory:", isolation_level=None))
    """
    _execute_script(conn, _SCHEMA_VERSION_TABLE + _MEASUREMENTS + _SEALS)


def _create(conn: sqlite3.Connection) -> None:
    create_schema(conn)


def _add_seals(conn: sqlite3.Connection) -> None:
    _execute_script(conn, _SEALS)


def _from_schema1(conn: sqlite3.Connection) -> None:
    from dspark.bench.ledger.measurement import Measurement

    _execute_script(conn, _MEASUREMENTS + _no_replace("results", "id"))
    rows = conn.execute("SELECT id, result_json FROM results ORDER BY timestamp, id").fetchall()
    previous = GENESIS
    for row_id, text in rows:
        old = json.loads(text)
        # Two schema-1 rows of one configuration in one run would share an id: the row id tells them apart.
        m = Measurement.from_schema1({**old, "config_hash": f"{old.get('config_hash', '')}-v1row{row_id}"})
        content = measurement_row(m)
        prev, previous = previous, row_hash(previous, content)
        conn.execute(insert_measurement_sql(), (*content, prev, previous))
    logger.info("migrated %d schema-1 results to measurements", len(rows))


def _seal_schema2(conn: sqlite3.Connection) -> None:
    # The only rewrite DSpark ever makes: adding the chain to rows that had none, when told to (see
    # [Note: no silent seal]).
    conn.execute("ALTER TABLE measurements ADD COLUMN prev_hash TEXT")
    conn.execute("ALTER TABLE measurements ADD COLUMN row_hash TEXT")
    conn.execute("DROP TRIGGER IF EXISTS measurements_no_update")
    previous = GENESIS
    columns = ", ".join(CONTENT_COLUMNS)
    rows = conn.execute(f"SELECT id, {columns} FROM measurements ORDER BY id").fetchall()
    for row_id, *content in rows:
        prev, previous = previous, row_hash(previous, tuple(content))
        conn.execute("UPDATE measurements SET prev_hash = ?, row_hash = ? WHERE id = ?",
                     (prev, previous, row_id))
    _execute_script(conn, _no_update("measurements"))
    logger.info("sealed %d schema-2 measurements into a hash chain", len(rows))


def measurement_row(m: Measurement) -> tuple[object, ...]:
    """The parameters of :func:`insert_measurement_sql` for measurement ``m``."""
    return (m.measurement_id, m.result_id, m.run_id, m.round_index,
            utc_timestamp(m.timestamp, what=m.measurement_id), m.git_commit, int(m.git_dirty),
            m.host, *m.key, m.config_hash, json.dumps(m.to_dict(), sort_keys=True))


# from version -> the steps that bring a ledger at that version to SCHEMA_VERSION (0: a new file)
_MIGRATIONS: dict[int, tuple[Callable[[sqlite3.Connection], None], ...]] = {
    0: (_create,), 1: (_from_schema1, _add_seals), 2: (_seal_schema2, _add_seals), 3: (_add_seals,)}
_UNCHAINED = (1, 2)
"""Versions without a hash chain: migrated only by an explicit seal (see [Note: no silent seal])."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _version(conn: sqlite3.Connection, path: Path) -> int:
    has_table = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema_version'").fetchone()
    if not has_table:
        if conn.execute("SELECT 1 FROM sqlite_master").fetchone():
            raise ValueError(f"{path} is an SQLite file but not a DSpark ledger (it has tables and "
                             "no schema_version); pass another --db or move it aside")
        return 0
    found = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
    if not isinstance(found, int) or isinstance(found, bool):
        raise ValueError(f"{path}: its schema_version table holds no version ({found!r}): the file "
                         "was altered outside DSpark; pass another --db")
    if found > SCHEMA_VERSION:
        raise ValueError(f"{path}: ledger schema version {found} is newer than this DSpark "
                         f"understands ({SCHEMA_VERSION}); upgrade DSpark")
    if found != SCHEMA_VERSION and (found not in _MIGRATIONS or found == 0):
        raise ValueError(f"{path}: ledger schema version {found!r} was never DSpark's (valid: 1 to "
                         f"{SCHEMA_VERSION}): the file was altered outside DSpark")
    return found


def _check_layout(conn: sqlite3.Connection, path: Path) -> None:
    """Refuse, in one line, a file at :data:`SCHEMA_VERSION` whose tables lack a column (a hash
    column dropped, say): nothing could be read or verified from it."""
    for table, columns in _COLUMNS.items():
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        missing = [column for column in columns if column not in have]
        if missing:
            what = f"table {table!r} lacks column(s) {missing}" if have else f"it has no table {table!r}"
            raise ValueError(f"{path}: {what}, which every schema-{SCHEMA_VERSION} DSpark ledger has: "
                             "the file was altered outside DSpark and cannot be verified")


def missing_triggers(conn: sqlite3.Connection) -> list[str]:
    """The append-only :data:`TRIGGERS` this ledger lacks (dropped outside DSpark)."""
    have = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
    return [name for name in TRIGGERS if name not in have]


_UNIQUE = {"measurements": ("id", "measurement_id"), "seals": ("id",)}


def _restore_triggers(conn: sqlite3.Connection) -> None:
    """Create the append-only triggers a sealed file lacks (an old file, or one altered by hand)."""
    for name in missing_triggers(conn):
        table, kind = name.rsplit("_no_", 1)
        if kind == "update":
            _execute_script(conn, _no_update(table))
        elif kind == "replace":
            _execute_script(conn, _no_replace(table, *_UNIQUE[table]))
        else:
            _execute_script(conn, f"CREATE TRIGGER {name} BEFORE DELETE ON {table} BEGIN SELECT "
                                  f"RAISE(ABORT, 'the DSpark ledger is append-only: {table} are never "
                                  "deleted'); END;")


def migrate(conn: sqlite3.Connection, path: Path, *, seal: bool = False) -> None:
    """Bring the ledger on ``conn`` (autocommit mode) to :data:`SCHEMA_VERSION` in one transaction,
    or refuse a file this DSpark does not know. A file without a hash chain (schema 1 or 2) is a
    :class:`LedgerUnsealed` unless ``seal=True``, which chains its rows and records the seal (see
    [Note: no silent seal]).

    Example::

        migrate(sqlite3.connect(path, isolation_level=None), path)
    """
    if _version(conn, path) == SCHEMA_VERSION:
        _check_layout(conn, path)
        return
    conn.execute("BEGIN IMMEDIATE")  # another process may be migrating the same file
    try:
        version = _version(conn, path)  # again, under the lock
        if version in _UNCHAINED and not seal:
            raise LedgerUnsealed(
                f"{path}: ledger schema {version} has no hash chain (written before DSpark chained "
                "its rows, or its chain was dropped), so nothing vouches for its rows; `dspark bench "
                f"verify --db {path} --seal` chains them as they are now, a seal every verify reports")
        if version != SCHEMA_VERSION:
            logger.info("ledger %s: migrating schema %d -> %d", path, version, SCHEMA_VERSION)
            for step in _MIGRATIONS[version]:
                step(conn)
            if version in _UNCHAINED:
                _restore_triggers(conn)
                rows, head = conn.execute("SELECT COUNT(*), (SELECT row_hash FROM measurements "
                                          "ORDER BY id DESC LIMIT 1) FROM measurements").fetchone()
                conn.execute("INSERT INTO seals (sealed_at, from_version, rows, head) VALUES (?, ?, ?, ?)",
                             (_now(), version, rows, head or GENESIS))
            conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                         (SCHEMA_VERSION, _now()))
        _check_layout(conn, path)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
