"""The ledger: every benchmark result ever recorded, in one SQLite file, append-only.

Reports, comparisons and ``rerun --stale`` are computed from it, so a result is never edited
after the fact: SQLite triggers abort any UPDATE or DELETE (see [Note: append-only]). Each row keeps
the columns queries filter on plus the whole ``BenchResult.to_dict()`` as JSON, which is what
comes back out, so a field added to the schema later needs no migration to be stored.

[Note: append-only]
The seed lost ~30 benchmarks to one bug and had to recompute them; which numbers were recorded
against which code is the evidence. A corrected result is a new row with a newer timestamp
(``latest_by_key`` then prefers it); the wrong one stays, tied to its commit.

[Note: time order]
"Latest" and "earlier" follow the result's own timestamp (normalised to UTC on insert, so ``Z``,
``+00:00`` and other offsets order correctly), then insertion order for equal timestamps.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType

from dspark.bench.result import BenchConfig, BenchResult, ConfigKey

__all__ = ["SCHEMA_VERSION", "Ledger", "RunSummary", "default_db_path", "utc_timestamp"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
"""Bump with a migration in ``_MIGRATIONS`` when the table layout changes."""

_KEY_COLUMNS = ("workload", "num_devices", "strategy", "precision", "batch_placement",
                "global_batch")

_SCHEMA_V1 = """
CREATE TABLE schema_version (
    version INTEGER NOT NULL,
    applied_at TEXT NOT NULL
);
CREATE TABLE results (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    timestamp TEXT NOT NULL,          -- UTC, normalised (see [Note: time order])
    git_commit TEXT NOT NULL,
    git_dirty INTEGER NOT NULL,
    workload TEXT NOT NULL,
    num_devices INTEGER NOT NULL,
    strategy TEXT NOT NULL,
    precision TEXT NOT NULL,
    batch_placement TEXT NOT NULL,
    global_batch INTEGER NOT NULL,
    config_hash TEXT NOT NULL,
    result_json TEXT NOT NULL
);
CREATE INDEX results_by_key ON results (workload, num_devices, strategy, precision,
                                        batch_placement, global_batch, timestamp);
CREATE INDEX results_by_run ON results (run_id);
CREATE INDEX results_by_commit ON results (git_commit);
CREATE TRIGGER results_no_update BEFORE UPDATE ON results
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: results are never updated'); END;
CREATE TRIGGER results_no_delete BEFORE DELETE ON results
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: results are never deleted'); END;
CREATE TRIGGER schema_version_no_update BEFORE UPDATE ON schema_version
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: schema versions are never updated'); END;
CREATE TRIGGER schema_version_no_delete BEFORE DELETE ON schema_version
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: schema versions are never deleted'); END;
"""

# version -> SQL that brings a ledger from version - 1 to it; version 1 creates it.
_MIGRATIONS: dict[int, str] = {1: _SCHEMA_V1}

_ORDER = "ORDER BY timestamp, id"


def default_db_path() -> Path:
    """Where ``dspark bench`` keeps its ledger unless told otherwise.

    ``$DSPARK_LEDGER`` if set, else ``$XDG_DATA_HOME/dspark/ledger.sqlite``, else
    ``~/.local/share/dspark/ledger.sqlite``.

    Example::

        Ledger(default_db_path())
    """
    explicit = os.environ.get("DSPARK_LEDGER")
    if explicit:
        return Path(explicit).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME")
    # The XDG spec says a relative XDG_DATA_HOME is invalid and must be ignored.
    base = Path(data_home) if data_home and Path(data_home).is_absolute() else (
        Path.home() / ".local" / "share")
    return base / "dspark" / "ledger.sqlite"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    """One ``dspark bench`` invocation as the ledger saw it."""

    run_id: str
    timestamp: str
    """UTC time of the run's first result."""
    git_commit: str
    git_dirty: bool
    """True when any of its results came from a tree with uncommitted changes."""
    num_results: int
    workloads: tuple[str, ...]


def utc_timestamp(timestamp: str, *, what: str = "result") -> str:
    """``timestamp`` (ISO 8601; naive means UTC) as UTC with microseconds, so strings sort in time.

    Example::

        utc_timestamp("2026-11-30T07:16:56+02:00")   # "2026-11-30T05:16:56.000000+00:00"
    """
    try:
        moment = datetime.fromisoformat(timestamp)
    except ValueError:
        raise ValueError(f"{what}: timestamp={timestamp!r} is not ISO 8601 "
                         "(e.g. '2026-11-30T05:16:56+00:00')") from None
    if moment.tzinfo is None:  # the schema says UTC; a naive time is read as such
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).isoformat(timespec="microseconds")


def _same_commit(recorded: str, current: str) -> bool:
    # Either side may be abbreviated; 7 hex digits is git's own shortest default.
    if not recorded or not current or min(len(recorded), len(current)) < 7:
        return recorded == current and bool(recorded)
    return recorded.startswith(current) or current.startswith(recorded)


class Ledger:
    """An append-only SQLite file of :class:`BenchResult` rows (created on first use).

    Example::

        with Ledger(default_db_path()) as ledger:
            ledger.append(results)
            stale = ledger.stale(current_commit="1e5fe8e")
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=30.0)
        try:
            self._migrate()
        except BaseException:
            self._conn.close()
            raise

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file (further calls fail)."""
        self._conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r})"

    def schema_version(self) -> int:
        """The layout version of this file (:data:`SCHEMA_VERSION` once opened)."""
        row = self._conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0])

    def _migrate(self) -> None:
        has_table = self._conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema_version'").fetchone()
        version = self.schema_version() if has_table else 0
        if version > SCHEMA_VERSION:
            raise ValueError(f"{self.path}: ledger schema version {version} is newer than this "
                             f"DSpark understands ({SCHEMA_VERSION}); upgrade DSpark")
        for target in range(version + 1, SCHEMA_VERSION + 1):
            logger.info("ledger %s: migrating schema to version %d", self.path, target)
            now = datetime.now(timezone.utc).isoformat(timespec="seconds")
            # executescript commits first and runs outside the implicit transaction, so the
            # migration and its version row are wrapped in one explicit transaction.
            self._conn.executescript(
                f"BEGIN; {_MIGRATIONS[target]}\n"
                f"INSERT INTO schema_version (version, applied_at) VALUES ({target}, '{now}'); "
                "COMMIT;")

    # -- writing ---------------------------------------------------------------------------------

    def append(self, results: Sequence[BenchResult]) -> None:
        """Insert ``results`` in one transaction (all or none).

        Each needs a ``run_id`` and an ISO 8601 ``timestamp``: without them a result could not be
        resolved, ordered, or told stale.

        Example::

            ledger.append(annotate(results, history=ledger))
        """
        rows = []
        for index, result in enumerate(results):
            if not isinstance(result, BenchResult):
                raise TypeError(f"results[{index}] is a {type(result).__name__}, "
                                "not a BenchResult")
            what = f"results[{index}] ({result.workload}, {result.num_devices} devices)"
            if not result.run_id:
                raise ValueError(f"{what}: run_id={result.run_id!r} is empty; the runner must "
                                 "name the invocation that produced it")
            rows.append((
                result.run_id, utc_timestamp(result.timestamp, what=what), result.git_commit,
                int(result.git_dirty), *result.key, result.config_hash,
                json.dumps(result.to_dict(), sort_keys=True)))
        with self._conn:  # one transaction: commits on success, rolls back on error
            self._conn.executemany(
                "INSERT INTO results (run_id, timestamp, git_commit, git_dirty, "
                f"{', '.join(_KEY_COLUMNS)}, config_hash, result_json) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

    # -- reading ---------------------------------------------------------------------------------

    def _select(self, where: str = "", params: Sequence[object] = ()) -> list[BenchResult]:
        sql = f"SELECT result_json FROM results {where} {_ORDER}"
        return [BenchResult.from_dict(json.loads(text))
                for (text,) in self._conn.execute(sql, tuple(params))]

    def results(self, *, run_id: str | None = None,
                commit: str | None = None) -> list[BenchResult]:
        """Results whose run id and/or git commit start with the given prefixes, oldest first.

        Example::

            ledger.results(commit="1e5fe8e")
        """
        clauses, params = [], []
        for column, prefix in (("run_id", run_id), ("git_commit", commit)):
            if prefix is not None:
                # substr rather than LIKE: run ids may hold '_' or '%', which LIKE would expand.
                clauses.append(f"substr({column}, 1, ?) = ?")
                params += [len(prefix), prefix]
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return self._select(where, params)

    def runs(self) -> list[RunSummary]:
        """One summary per run, oldest first.

        Example::

            [run.run_id for run in ledger.runs()]
        """
        rows = self._conn.execute(
            "SELECT run_id, MIN(timestamp), MIN(id), COUNT(*), MAX(git_dirty), "
            "GROUP_CONCAT(DISTINCT git_commit), GROUP_CONCAT(DISTINCT workload) "
            "FROM results GROUP BY run_id ORDER BY MIN(timestamp), MIN(id)").fetchall()
        return [RunSummary(run_id=run_id, timestamp=timestamp, git_commit=commits or "",
                           git_dirty=bool(dirty), num_results=count,
                           workloads=tuple(sorted(set((workloads or "").split(",")))))
                for run_id, timestamp, _, count, dirty, commits, workloads in rows]

    def latest_by_key(self) -> dict[ConfigKey, BenchResult]:
        """The newest result of every configuration.

        Example::

            ledger.latest_by_key()[("resnet50-cpu", 1, "replicate", "bf16", "shard", 32)]
        """
        latest: dict[ConfigKey, BenchResult] = {}
        for result in self._select():  # oldest first, so later rows overwrite earlier ones
            latest[result.key] = result
        return latest

    def previous(self, result: BenchResult) -> BenchResult | None:
        """The newest result of the same configuration recorded before ``result``.

        Results of ``result``'s own run are skipped, so this works whether or not ``result`` has
        been appended yet. Example::

            old = ledger.previous(new)   # None the first time a configuration is measured
        """
        where = " AND ".join(f"{column} = ?" for column in _KEY_COLUMNS)
        params: list[object] = list(result.key)
        if result.timestamp:
            where += " AND timestamp < ?"
            params.append(utc_timestamp(result.timestamp, what="previous()"))
        if result.run_id:
            where += " AND run_id != ?"
            params.append(result.run_id)
        earlier = self._select(f"WHERE {where}", params)
        return earlier[-1] if earlier else None

    def stale(self, current_commit: str, *, current_dirty: bool = False) -> list[BenchConfig]:
        """Configurations whose newest result was measured on other code than ``current_commit``.

        Other code means another commit, or uncommitted changes on top of any commit (what a
        dirty tree held is unknown). With ``current_dirty=True`` (the code now has uncommitted
        changes) every configuration is stale. Rebuilt as :class:`BenchConfig` with the result's
        own warm-up and measured step counts, sorted by configuration.

        Example::

            for config in ledger.stale("1e5fe8e01ae5"): ...
        """
        if not current_commit:
            raise ValueError(f"current_commit={current_commit!r} is empty: stale() needs the git "
                             "commit the code is at now")
        configs = []
        for key, result in sorted(self.latest_by_key().items()):
            if (current_dirty or result.git_dirty
                    or not _same_commit(result.git_commit, current_commit)):
                configs.append(_config_of(key, result))
        return configs

    def resolve(self, ref: str) -> list[BenchResult]:
        """The results a user means by ``ref``, oldest first.

        ``ref`` is ``"latest"`` or ``"previous"`` (the newest run, the one before), a run id or
        unique prefix of one, or a git commit prefix (then the newest result of each
        configuration measured at that commit). Unknown or ambiguous refs raise ``ValueError``
        listing the candidates.

        Example::

            ledger.resolve("latest"); ledger.resolve("1e5fe8e")
        """
        runs = self.runs()
        run_ids = [run.run_id for run in runs]
        if ref in ("latest", "previous"):
            needed = 1 if ref == "latest" else 2
            if len(runs) < needed:
                raise ValueError(f"ref={ref!r}: the ledger {self.path} holds {len(runs)} run(s)")
            return self._select("WHERE run_id = ?", [run_ids[-needed]])
        if not ref:
            raise ValueError("ref='' is empty; pass 'latest', 'previous', a run id or a commit")
        if ref in run_ids:
            return self._select("WHERE run_id = ?", [ref])
        run_matches = [run_id for run_id in run_ids if run_id.startswith(ref)]
        if len(run_matches) == 1:
            return self._select("WHERE run_id = ?", run_matches)
        if len(run_matches) > 1:
            raise ValueError(f"ref={ref!r} matches {len(run_matches)} runs: "
                             f"{', '.join(run_matches)}; give more characters")
        commits = sorted({row[0] for row in self._conn.execute(
            "SELECT DISTINCT git_commit FROM results WHERE substr(git_commit, 1, ?) = ?",
            (len(ref), ref))})
        if len(commits) > 1:
            raise ValueError(f"ref={ref!r} matches {len(commits)} commits: "
                             f"{', '.join(commits)}; give more characters")
        if commits:
            latest: dict[ConfigKey, BenchResult] = {}
            for result in self._select("WHERE git_commit = ?", commits):
                latest[result.key] = result
            return sorted(latest.values(), key=lambda r: utc_timestamp(r.timestamp, what=ref))
        known = sorted({row[0] for row in self._conn.execute(
            "SELECT DISTINCT git_commit FROM results")})
        raise ValueError(f"ref={ref!r} is neither 'latest', 'previous', a run id nor a commit in "
                         f"{self.path}; runs: {', '.join(run_ids) or '(none)'}; "
                         f"commits: {', '.join(known) or '(none)'}")


def _config_of(key: ConfigKey, result: BenchResult) -> BenchConfig:
    workload, num_devices, strategy, precision, batch_placement, global_batch = key
    # measure_steps=0 means the result predates step counts: keep BenchConfig's defaults then.
    steps = ({"warmup_steps": result.warmup_steps, "measure_steps": result.measure_steps}
             if result.measure_steps > 0 else {})
    return BenchConfig(workload=workload, num_devices=num_devices, strategy=strategy,
                       precision=precision, batch_placement=batch_placement,
                       global_batch=global_batch, **steps)
