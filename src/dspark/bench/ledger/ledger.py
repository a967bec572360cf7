"""The ledger: every benchmark measurement ever recorded, in one SQLite file, append-only.

Each launch of a configuration (a round, see :mod:`dspark.bench.ledger.measurement`) is one row, written
as soon as it is measured, so a suite that dies half-way keeps what it finished. A row keeps the
raw figures (every step of every rank, core loads, bytes held); results, speedups and anomalies are
computed from them whenever they are read, so a corrected rule reaches old measurements. Triggers
refuse UPDATE, DELETE and an INSERT over an existing id (see [Note: append-only for real] in
:mod:`dspark.bench.ledger.schema`, which also holds the migration from schema 1).

[Note: append-only]
The seed lost ~30 benchmarks to one bug and had to recompute them; which numbers were recorded
against which code is the evidence. A corrected result is a new row with a newer timestamp
(``latest_by_key`` then prefers it); the wrong one stays, tied to its commit.

[Note: time order]
"Latest" and "earlier" follow the measurement's own timestamp (normalised to UTC on insert, so
``Z``, ``+00:00`` and other offsets order correctly), then insertion order for equal timestamps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from dspark.bench.faults import is_injected
from dspark.bench.ledger.chain import GENESIS, ChainReport, Seal, row_hash, verify_rows
from dspark.bench.ledger.measurement import Measurement, results_from_measurements
from dspark.bench.ledger.rows import ROWS_SUFFIX, load_rows, write_rows
from dspark.bench.ledger.schema import (
    CONTENT_COLUMNS,
    KEY_COLUMNS,
    SCHEMA_VERSION,
    LedgerUnsealed,
    insert_measurement_sql,
    measurement_row,
    migrate,
    missing_triggers,
    utc_timestamp,
)
from dspark.bench.result import BenchConfig, BenchResult, ConfigKey

__all__ = ["SCHEMA_VERSION", "ChainReport", "Ledger", "LedgerTampered", "LedgerUnsealed", "RunSummary",
           "Seal", "default_db_path", "utc_timestamp"]

logger = logging.getLogger(__name__)

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


class LedgerTampered(ValueError):
    """Results asked for rest on rows the hash chain does not vouch for (see [Note: hash chain])."""


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
    """Configurations measured (each possibly over several rounds)."""
    workloads: tuple[str, ...]
    hosts: tuple[str, ...] = ()


def _same_commit(recorded: str, current: str) -> bool:
    # Either side may be abbreviated; 7 hex digits is git's own shortest default.
    if not recorded or not current or min(len(recorded), len(current)) < 7:
        return recorded == current and bool(recorded)
    return recorded.startswith(current) or current.startswith(recorded)


class Ledger:
    """An append-only SQLite file of :class:`Measurement` rows (created on first use), read back as
    :class:`BenchResult` values.

    Example::

        with Ledger(default_db_path()) as ledger:
            ledger.append(measurement)
            stale = ledger.stale("1e5fe8e", host="box")
    """

    def __init__(self, path: str | Path, *, create: bool = True, seal: bool = False) -> None:
        """Open the ledger at ``path``; with ``create=False`` (a command that only reads) a missing
        file is a ``FileNotFoundError`` instead of a new empty ledger. A directory, or a file that is
        not a DSpark ledger, is a ``ValueError`` naming the path; a ledger without a hash chain a
        :class:`LedgerUnsealed` unless ``seal=True`` (see [Note: no silent seal]). A ``.jsonl`` path
        is a kept artifact's rows (see [Note: kept rows]), read into memory, read-only."""
        self.path = Path(path).expanduser()
        self._untrusted: frozenset[str] = frozenset()
        """Measurement ids :meth:`verify` found bad: left out of everything read after it."""
        self.read_only = self.path.suffix == ROWS_SUFFIX
        if self.read_only:
            if not self.path.is_file():
                raise FileNotFoundError(f"no ledger rows file at {str(self.path)!r} (`dspark bench "
                                        "export --rows PATH` writes one)")
            self._conn = sqlite3.connect(":memory:", isolation_level=None)
            try:
                load_rows(self._conn, self.path)
            except BaseException:
                self._conn.close()
                raise
            return
        if self.path.is_dir():
            raise ValueError(f"ledger path {str(self.path)!r} is a directory; give a file path, e.g. "
                             f"{str(self.path / 'bench.sqlite')!r}")
        above = next((p for p in self.path.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise ValueError(f"ledger path {str(self.path)!r}: {str(above)!r} is a file, not a directory")
        if not create and not self.path.exists():
            raise FileNotFoundError(f"no ledger at {str(self.path)!r}: `dspark bench` writes one there "
                                    "(or pass --db with the path of an existing ledger)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Autocommit mode: every write below opens and closes its own transaction explicitly.
            self._conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        except sqlite3.Error as err:
            raise ValueError(f"cannot open the ledger {str(self.path)!r}: {err}") from err
        try:
            migrate(self._conn, self.path, seal=seal)
        except sqlite3.OperationalError as err:
            self._conn.close()
            if any(word in str(err) for word in ("locked", "readonly", "disk", "unable to open")):
                raise  # locked, read-only, disk full: not the file's kind
            raise ValueError(f"{str(self.path)!r} is not a DSpark ledger as DSpark writes it "
                             f"(SQLite: {err}): it was altered outside DSpark") from None
        except sqlite3.DatabaseError as err:
            self._conn.close()
            raise ValueError(f"{str(self.path)!r} is not a DSpark ledger (SQLite: {err}); pass --db "
                             "with a ledger's path, or a new path to start one") from err
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

    # -- writing ---------------------------------------------------------------------------------

    def append(self, measurements: Measurement | Sequence[Measurement]) -> None:
        """Insert one measurement, or several in one transaction (all or none).

        Each needs a ``run_id``, a ``config_hash`` and an ISO 8601 ``timestamp``: without them it
        could not be grouped, ordered, or told stale. A measurement whose id (run, configuration,
        round) is already recorded is refused.

        Example::

            ledger.append(measurement)   # right after the launch that measured it
        """
        if self.read_only:
            raise ValueError(f"{str(self.path)!r} is a kept artifact's rows, read-only: record into "
                             "an SQLite ledger (--db PATH.sqlite)")
        items = [measurements] if isinstance(measurements, Measurement) else list(measurements)
        rows = []
        for index, m in enumerate(items):
            if not isinstance(m, Measurement):
                raise TypeError(f"measurements[{index}] is a {type(m).__name__}, not a Measurement")
            what = f"measurements[{index}] ({m.workload}, {m.num_devices} device(s))"
            if not m.run_id or not m.config_hash:
                raise ValueError(f"{what}: run_id={m.run_id!r} and config_hash={m.config_hash!r} "
                                 "must be set; the runner names the invocation and configuration")
            utc_timestamp(m.timestamp, what=what)
            rows.append(measurement_row(m))
        self._conn.execute("BEGIN IMMEDIATE")  # the chain's last link, read under the write lock
        try:
            previous = self.head()
            for content in rows:
                prev, previous = previous, row_hash(previous, content)
                self._conn.execute(insert_measurement_sql(), (*content, prev, previous))
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # -- the hash chain ----------------------------------------------------------------------------

    def head(self) -> str:
        """The newest row's hash: keep it elsewhere (a CI log) to pin everything up to it."""
        row = self._conn.execute("SELECT row_hash FROM measurements ORDER BY id DESC LIMIT 1").fetchone()
        return str(row[0]) if row and row[0] is not None else GENESIS

    def verify(self, *, head: str | None = None) -> ChainReport:
        """Check every row against the hash chain and its own content (see [Note: hash chain]),
        and, with ``head`` (kept elsewhere), that the chain still reaches it; the report also names
        missing append-only triggers and every seal (see [Note: no silent seal]). From then on, what
        this object reads leaves out the rows found bad.

        Example::

            report = ledger.verify(head=kept_head)
            report.first_bad   # None, or the first row that fails, with the reason
        """
        columns = ", ".join(CONTENT_COLUMNS)
        report = verify_rows(self._conn.execute(
            f"SELECT id, {columns}, prev_hash, row_hash FROM measurements ORDER BY id"),
            CONTENT_COLUMNS, pinned=head)
        self._untrusted = frozenset(row.measurement_id for row in report.bad)
        faults = [*report.faults, *(f"its append-only trigger {name!r} is missing: the file was "
                                    "altered outside DSpark" for name in missing_triggers(self._conn))]
        return dataclasses.replace(report, faults=tuple(faults), seals=self.seals())

    def seals(self) -> tuple[Seal, ...]:
        """Every time DSpark chained rows that had no hash (see [Note: no silent seal]), oldest first."""
        return tuple(Seal(sealed_at=str(at), from_version=int(version), rows=int(rows), head=str(head))
                     for at, version, rows, head in self._conn.execute(
                         "SELECT sealed_at, from_version, rows, head FROM seals ORDER BY id"))

    def export_rows(self, path: str | Path) -> int:
        """Write every row, with its hashes, to ``path`` (see [Note: kept rows]); returns the count.

        Example::

            ledger.export_rows("benchmarks/results/x/ledger.jsonl")
        """
        return write_rows(self._conn, Path(path))

    def require_intact(self, report: ChainReport, run_ids: Sequence[str] | None = None) -> None:
        """Refuse (:class:`LedgerTampered`) when ``report`` found a bad row in one of ``run_ids``
        (any run when None), naming the first such row and how to see them all."""
        if report.faults:
            raise LedgerTampered(f"{self.path}: {report.faults[0]}; no result of it is shown "
                                 f"(`dspark bench verify --db {self.path}`)")
        bad = [row for row in report.bad if run_ids is None or row.run_id in run_ids]
        if bad:
            raise LedgerTampered(
                f"{self.path}: {len(bad)} row(s) fail the ledger's hash chain, first {bad[0]}; "
                f"their results are not shown (`dspark bench verify --db {self.path}` lists them)")

    # -- reading ---------------------------------------------------------------------------------

    def _select(self, where: str = "", params: Sequence[object] = ()) -> list[Measurement]:
        sql = f"SELECT id, measurement_id, measurement_json FROM measurements {where} {_ORDER}"
        found = []
        for row_id, measurement_id, text in self._conn.execute(sql, tuple(params)):
            if measurement_id in self._untrusted:
                continue
            try:
                found.append(Measurement.from_dict(json.loads(text)))
            except (ValueError, TypeError, RecursionError) as exc:
                raise LedgerTampered(f"{self.path}: row {row_id} ({measurement_id!r}) does not read as "
                                     f"a measurement ({type(exc).__name__}); `dspark bench verify "
                                     f"--db {self.path}` names every such row") from None
        return found

    def measurements(self, *, run_id: str | None = None, commit: str | None = None,
                     host: str | None = None) -> list[Measurement]:
        """Raw measurements whose run id and/or git commit start with the given prefixes (and from
        ``host`` exactly, when given), oldest first.

        Example::

            ledger.measurements(run_id="20261130T052013Z")
        """
        clauses, params = [], []
        for column, prefix in (("run_id", run_id), ("git_commit", commit)):
            if prefix is not None:
                # substr rather than LIKE: run ids may hold '_' or '%', which LIKE would expand.
                clauses.append(f"substr({column}, 1, ?) = ?")
                params += [len(prefix), prefix]
        if host is not None:
            clauses.append("host = ?")
            params.append(host)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        return self._select(where, params)

    def results(self, *, run_id: str | None = None, commit: str | None = None,
                host: str | None = None) -> list[BenchResult]:
        """One result per configuration per run (filters as :meth:`measurements`), oldest first,
        summarised from the raw rounds; pass them through :func:`dspark.bench.analyse.analysis.annotate`
        for speedups and anomalies.

        Example::

            ledger.results(commit="1e5fe8e")
        """
        return results_from_measurements(self.measurements(run_id=run_id, commit=commit, host=host))

    def runs(self) -> list[RunSummary]:
        """One summary per run, oldest first.

        Example::

            [run.run_id for run in ledger.runs()]
        """
        rows = self._conn.execute(
            "SELECT run_id, MIN(timestamp), MIN(id), COUNT(DISTINCT result_id), MAX(git_dirty), "
            "GROUP_CONCAT(DISTINCT git_commit), GROUP_CONCAT(DISTINCT workload), "
            "GROUP_CONCAT(DISTINCT host) "
            "FROM measurements GROUP BY run_id ORDER BY MIN(timestamp), MIN(id)").fetchall()
        return [RunSummary(run_id=run_id, timestamp=timestamp, git_commit=commits or "",
                           git_dirty=bool(dirty), num_results=count,
                           workloads=tuple(sorted(set((workloads or "").split(",")))),
                           hosts=tuple(sorted(set((hosts or "").split(",")))))
                for run_id, timestamp, _, count, dirty, commits, workloads, hosts in rows]

    def latest_by_key(self, *, host: str | None = None) -> dict[ConfigKey, BenchResult]:
        """The newest result of every configuration (measured on ``host``, when given).

        Example::

            ledger.latest_by_key(host="box")[("resnet50-cpu", 1, "replicate", "bf16", "shard", 128)]
        """
        latest: dict[ConfigKey, BenchResult] = {}
        for result in self.results(host=host):  # oldest first: later results overwrite earlier
            latest[result.key] = result
        return latest

    def previous(self, result: BenchResult) -> BenchResult | None:
        """The newest result of the same configuration on the same host recorded before
        ``result``, from another run (so this works whether or not ``result`` is recorded).

        Example::

            old = ledger.previous(new)   # None the first time a configuration is measured here
        """
        where = " AND ".join(f"{column} = ?" for column in KEY_COLUMNS) + " AND host = ?"
        params: list[object] = [*result.key, result.host]
        if result.timestamp:
            where += " AND timestamp < ?"
            params.append(utc_timestamp(result.timestamp, what="previous()"))
        if result.run_id:
            where += " AND run_id != ?"
            params.append(result.run_id)
        earlier = [r for r in results_from_measurements(self._select(f"WHERE {where}", params))
                   if not is_injected(r)]  # see [Note: injected faults]
        return earlier[-1] if earlier else None

    def stale(self, current_commit: str, *, host: str,
              current_dirty: bool = False) -> list[BenchConfig]:
        """Configurations measured on ``host`` whose newest result there came from other code than
        ``current_commit``. Other hosts' rows are never considered: a configuration measured on an
        8-GPU box is not this machine's to re-run.

        Other code means another commit, or uncommitted changes on top of any commit (what a
        dirty tree held is unknown). With ``current_dirty=True`` (the code now has uncommitted
        changes) every configuration of ``host`` is stale. Rebuilt as :class:`BenchConfig` with
        the result's own warm-up and measured step counts, sorted by configuration.

        Example::

            for config in ledger.stale("1e5fe8e01ae5", host=socket.gethostname()): ...
        """
        if not current_commit:
            raise ValueError(f"current_commit={current_commit!r} is empty: stale() needs the git "
                             "commit the code is at now")
        if not host:
            raise ValueError("host='' is empty: stale() re-runs only what this host measured")
        return [result.config for _, result in sorted(self.latest_by_key(host=host).items())
                if current_dirty or result.git_dirty
                or not _same_commit(result.git_commit, current_commit)]

    def resolve(self, ref: str) -> list[BenchResult]:
        """The results a user means by ``ref``, oldest first.

        ``ref`` is ``"latest"`` or ``"previous"`` (the newest run, the one before), a run id or
        unique prefix of one, or a git commit prefix (then the newest run at that commit). The
        results are always those of one run. Unknown or ambiguous refs raise ``ValueError``
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
            return self._run(run_ids[-needed])
        if not ref:
            raise ValueError("ref='' is empty; pass 'latest', 'previous', a run id or a commit")
        if ref in run_ids:
            return self._run(ref)
        run_matches = [run_id for run_id in run_ids if run_id.startswith(ref)]
        if len(run_matches) == 1:
            return self._run(run_matches[0])
        if len(run_matches) > 1:
            raise ValueError(f"ref={ref!r} matches {len(run_matches)} runs: "
                             f"{', '.join(run_matches)}; give more characters")
        commits = sorted({row[0] for row in self._conn.execute(
            "SELECT DISTINCT git_commit FROM measurements WHERE substr(git_commit, 1, ?) = ?",
            (len(ref), ref))})
        if len(commits) > 1:
            raise ValueError(f"ref={ref!r} matches {len(commits)} commits: "
                             f"{', '.join(commits)}; give more characters")
        if commits:
            # The newest run at that commit, whole: never one run's results beside another's
            # (a ratio across two runs would pair launches minutes or days apart).
            at_commit = [run.run_id for run in runs if commits[0] in run.git_commit.split(",")]
            return self._run(at_commit[-1])
        known = sorted({row[0] for row in self._conn.execute(
            "SELECT DISTINCT git_commit FROM measurements")})
        raise ValueError(f"ref={ref!r} is neither 'latest', 'previous', a run id nor a commit in "
                         f"{self.path}; runs: {', '.join(run_ids) or '(none)'}; "
                         f"commits: {', '.join(known) or '(none)'}")

    def _run(self, run_id: str) -> list[BenchResult]:
        return results_from_measurements(self._select("WHERE run_id = ?", [run_id]))
