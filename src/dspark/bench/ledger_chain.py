"""The ledger's hash chain, and the check of every row against it and against its own content.

[Note: hash chain]
Triggers refuse UPDATE, DELETE and INSERT OR REPLACE (see [Note: append-only for real] in
:mod:`dspark.bench.ledger_schema`), but SQLite cannot forbid schema surgery: DROP TRIGGER, UPDATE,
CREATE TRIGGER rewrites a row, and a plain INSERT with a fresh id adds rounds no run measured. So
every measurement row also carries ``row_hash = sha256(prev_hash, its content)``, where
``prev_hash`` is the row before it's ``row_hash`` (:data:`GENESIS` for the first), and its ids must
be the ones its content implies (``<run>/<config hash>/r<round>``, the configuration hash of the
configuration it holds, a round below the rounds its run planned). :func:`verify_rows` walks the
chain in insertion order and names every row that breaks it:

* a row written without DSpark (no hash), or whose hash does not match its content (rewritten);
* a row whose ``prev_hash`` is not the previous row's hash (a row deleted or slipped in before it);
* a row whose ids or columns disagree with its JSON, or whose round is beyond its run's plan.

What it cannot see: a forger who recomputes the chain with this very code, or removes the newest
rows. ``dspark bench`` prints the chain's head after every run and ``dspark bench verify`` prints
it too: a head kept elsewhere (a CI log) pins everything up to it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["GENESIS", "BadRow", "ChainReport", "row_hash", "verify_rows"]

GENESIS = "0" * 64
"""The ``prev_hash`` of a ledger's first row."""


def row_hash(prev_hash: str, content: Sequence[object]) -> str:
    """The hash of one row: ``prev_hash`` and the row's content columns, as canonical JSON.

    Example::

        row_hash(GENESIS, measurement_row(m))   # 64 hex digits
    """
    payload = json.dumps([prev_hash, *content], separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class BadRow:
    """A row the chain or its own content does not vouch for."""

    row_id: int
    """SQLite's ``id`` (insertion order)."""
    measurement_id: str
    run_id: str
    reason: str

    def __str__(self) -> str:
        return f"row {self.row_id} ({self.measurement_id}): {self.reason}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainReport:
    """What :func:`verify_rows` found."""

    rows: int
    bad: tuple[BadRow, ...]
    head: str
    """The last row's stored ``row_hash`` (:data:`GENESIS` for an empty ledger)."""

    @property
    def ok(self) -> bool:
        return not self.bad

    @property
    def first_bad(self) -> BadRow | None:
        return self.bad[0] if self.bad else None

    @property
    def bad_runs(self) -> frozenset[str]:
        return frozenset(row.run_id for row in self.bad)


def _content_faults(content: Sequence[object], columns: Sequence[str]) -> list[str]:
    from dspark.bench.measurement import Measurement

    row = dict(zip(columns, content, strict=True))
    try:
        m = Measurement.from_dict(json.loads(str(row["measurement_json"])))
    except (ValueError, TypeError) as exc:
        return [f"its JSON does not read as a measurement ({exc})"]
    faults = []
    if row["measurement_id"] != m.measurement_id:
        faults.append(f"its id {row['measurement_id']!r} is not the one its content implies "
                      f"({m.measurement_id!r})")
    for column in columns:
        if column in ("measurement_id", "measurement_json", "timestamp"):
            continue
        held = getattr(m, column, None)
        held = int(held) if isinstance(held, bool) else held
        if row[column] != held:
            faults.append(f"column {column}={row[column]!r} but its JSON says {held!r}")
    legacy = "-v1row" in m.config_hash or m.measure_steps == 0  # migrated from schema 1
    if not legacy and m.config_hash != m.config.config_hash():
        faults.append(f"its config_hash {m.config_hash!r} is not the hash of the configuration it "
                      f"holds ({m.config.config_hash()!r})")
    if m.rounds_planned and not 0 <= m.round_index < m.rounds_planned:
        faults.append(f"round {m.round_index} of a run that planned {m.rounds_planned} round(s)")
    return faults


def verify_rows(rows: Iterable[Sequence[object]], columns: Sequence[str]) -> ChainReport:
    """Check rows ``(id, *content, prev_hash, row_hash)`` in insertion order, ``content`` named by
    ``columns``; every row that breaks the chain or disagrees with itself is in the report.

    Example::

        verify_rows(conn.execute("SELECT id, ..., prev_hash, row_hash FROM measurements ORDER BY id"),
                    CONTENT_COLUMNS).first_bad
    """
    bad: list[BadRow] = []
    expected_prev, count, previous_id = GENESIS, 0, None
    for row_id, *rest in rows:
        *content, prev_hash, stored = rest
        count += 1
        names = dict(zip(columns, content, strict=True))
        reasons = []
        if stored is None:
            reasons.append("it has no hash: it was written without DSpark")
        else:
            if prev_hash != expected_prev:
                where = f"row {previous_id}'s" if previous_id is not None else "the chain's start"
                reasons.append(f"its prev_hash does not link to {where} hash: a row was deleted, "
                               "inserted or rewritten before it")
            if row_hash(str(prev_hash), content) != stored:
                reasons.append("its content does not match its hash: it was changed after it was "
                               "recorded")
        reasons += _content_faults(content, columns)
        if reasons:
            bad.append(BadRow(row_id=int(str(row_id)), measurement_id=str(names["measurement_id"]),
                              run_id=str(names["run_id"]), reason="; ".join(reasons)))
        expected_prev = str(stored) if stored is not None else expected_prev
        previous_id = row_id
    return ChainReport(rows=count, bad=tuple(bad), head=expected_prev)
