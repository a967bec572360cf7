"""The ledger's hash chain, and the check of every row against it and against its own content.

[Note: hash chain]
Triggers refuse UPDATE, DELETE and INSERT OR REPLACE (see [Note: append-only for real] in
:mod:`dspark.bench.ledger.schema`), but SQLite cannot forbid schema surgery: DROP TRIGGER, UPDATE,
CREATE TRIGGER rewrites a row, and a plain INSERT with a fresh id adds rounds no run measured. So
every measurement row also carries ``row_hash = sha256(prev_hash, its content)``, where
``prev_hash`` is the row before it's ``row_hash`` (:data:`GENESIS` for the first), and its ids must
be the ones its content implies (``<run>/<config hash>/r<round>``, the configuration hash of the
configuration it holds, a round below the rounds its run planned). :func:`verify_rows` walks the
chain in insertion order and names every row that breaks it:

* a row written without DSpark (no hash), or whose hash does not match its content (rewritten);
* a row whose ``prev_hash`` is not the previous row's hash (a row deleted or slipped in before it);
* a row whose ids or columns disagree with its JSON, or whose round is beyond its run's plan.

What the chain alone cannot see: a forger who recomputes it with this very code, or removes the
newest rows. A head kept elsewhere catches both: ``dspark bench`` prints the chain's head after every
run, ``dspark bench verify`` prints it too, and ``dspark bench verify --head H`` requires ``H`` to be
some row's hash, every row up to it intact (rows appended after it are reported, not refused). Each
artifact under ``benchmarks/results/`` keeps its rows with their hashes and its head in
``benchmarks/results/HEADS``, a tracked file whose git history shows any head that changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["GENESIS", "BadRow", "ChainReport", "Seal", "check_head", "row_hash", "verify_rows"]

GENESIS = "0" * 64
"""The ``prev_hash`` of a ledger's first row."""


def check_head(head: str) -> str:
    """``head`` as a row hash is written: 64 lowercase hex digits (case and surrounding blanks are
    forgiven). Anything else is a ``ValueError`` naming it: a shortened head (the 16 digits ``make
    figures`` prints) is no row's hash, and checked as one it would read as a tampered ledger.

    Example::

        check_head(" 1455441DA9...E88F4 ")   # "1455441da9...e88f4"
    """
    text = head.strip().lower() if isinstance(head, str) else ""
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"head {head!r:.80} is not a chain head ({len(text)} characters where a head "
                         "has 64 hex digits): give the whole head, as `dspark bench verify` prints it "
                         "and benchmarks/results/HEADS keeps it")
    return text


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
class Seal:
    """Rows DSpark chained that had no hash (see [Note: no silent seal] in
    :mod:`dspark.bench.ledger.schema`): what they held before ``sealed_at`` is not vouched for."""

    sealed_at: str
    from_version: int
    rows: int
    head: str

    def __str__(self) -> str:
        return (f"rows 1-{self.rows} were chained on {self.sealed_at} from an unchained schema-"
                f"{self.from_version} file (head then {self.head}): what they held before that is "
                "not vouched for")


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainReport:
    """What :func:`verify_rows` found."""

    rows: int
    bad: tuple[BadRow, ...]
    head: str
    """The last row's stored ``row_hash`` (:data:`GENESIS` for an empty ledger)."""
    pinned: str | None = None
    """The head the rows were checked against (``--head``), if any."""
    after_pinned: int = 0
    """Rows appended after the pinned head's row."""
    faults: tuple[str, ...] = ()
    """What is wrong with the file as a whole: the pinned head is no row's, a trigger is missing."""
    seals: tuple[Seal, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.bad and not self.faults

    @property
    def first_bad(self) -> BadRow | None:
        return self.bad[0] if self.bad else None

    @property
    def bad_runs(self) -> frozenset[str]:
        return frozenset(row.run_id for row in self.bad)


def _content_faults(content: Sequence[object], columns: Sequence[str]) -> list[str]:
    from dspark.bench.ledger.measurement import Measurement

    row = dict(zip(columns, content, strict=True))
    try:
        m = Measurement.from_dict(json.loads(str(row["measurement_json"])))
    except (ValueError, TypeError, RecursionError) as exc:
        return [f"its JSON does not read as a measurement ({type(exc).__name__}: {str(exc)[:200]})"]
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


def verify_rows(rows: Iterable[Sequence[object]], columns: Sequence[str], *,
                pinned: str | None = None) -> ChainReport:
    """Check rows ``(id, *content, prev_hash, row_hash)`` in insertion order, ``content`` named by
    ``columns``; every row that breaks the chain or disagrees with itself is in the report. With
    ``pinned`` (a head kept elsewhere), a fault unless some row's hash is ``pinned``: a row at or
    before it was deleted, or the chain recomputed.

    Example::

        verify_rows(conn.execute("SELECT id, ..., prev_hash, row_hash FROM measurements ORDER BY id"),
                    CONTENT_COLUMNS).first_bad
    """
    pinned = None if pinned is None else check_head(pinned)
    bad: list[BadRow] = []
    expected_prev, count, previous_id = GENESIS, 0, None
    pinned_at = 0 if pinned == GENESIS else None
    for row_id, *rest in rows:
        *content, prev_hash, stored = rest
        count += 1
        if pinned is not None and stored == pinned:
            pinned_at = count
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
    faults: tuple[str, ...] = ()
    if pinned is not None and pinned_at is None:
        faults = (f"the pinned head {pinned} is no row's hash (the chain now ends at "
                  f"{expected_prev}, after {count} row(s)): a row at or before it was deleted, or "
                  "changed and the chain recomputed",)
    return ChainReport(rows=count, bad=tuple(bad), head=expected_prev, pinned=pinned,
                       after_pinned=count - (pinned_at or 0) if pinned_at is not None else 0,
                       faults=faults)
