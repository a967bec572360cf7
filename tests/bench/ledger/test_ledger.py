from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.ledger.ledger import SCHEMA_VERSION, Ledger, LedgerUnsealed, default_db_path
from dspark.bench.ledger.measurement import Measurement
from dspark.bench.ledger.schema import insert_measurement_sql, measurement_row
from dspark.bench.result import BenchConfig
from tests.bench.factory import make_measurement, make_result, phase_stats
from tests.messages import assert_names

OLD = "aaaaaaa1111111111111111111111111111111111"
NEW = "bbbbbbb2222222222222222222222222222222222"

# The layout DSpark wrote before measurements were kept raw, as it was (for the migration test).
_SCHEMA_1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at TEXT NOT NULL);
CREATE TABLE results (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, timestamp TEXT NOT NULL,
    git_commit TEXT NOT NULL, git_dirty INTEGER NOT NULL, workload TEXT NOT NULL,
    num_devices INTEGER NOT NULL, strategy TEXT NOT NULL, precision TEXT NOT NULL,
    batch_placement TEXT NOT NULL, global_batch INTEGER NOT NULL, config_hash TEXT NOT NULL,
    result_json TEXT NOT NULL);
CREATE TRIGGER results_no_update BEFORE UPDATE ON results
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: results are never updated'); END;
CREATE TRIGGER results_no_delete BEFORE DELETE ON results
BEGIN SELECT RAISE(ABORT, 'the DSpark ledger is append-only: results are never deleted'); END;
INSERT INTO schema_version VALUES (1, '2026-11-30T00:00:00+00:00');
"""


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(tmp_path / "deep" / "dir" / "ledger.sqlite") as opened:
        yield opened


def test_round_trip_keeps_every_field(ledger: Ledger) -> None:
    original = make_measurement(git_dirty=True, step_ms_summary=[1.0, 0.5, 2.0],
                                estimated_comm_bytes_per_step=7, engine_options={"x": None},
                                optimizer_kernel="fused", cpu_malloc="dspark", micro_batches=4,
                                max_micro_batch=8,
                                estimated_comm_wire_bytes_per_step=9, round_index=2,
                                batch={"samples_by_rank": [4, 4], "identical_input_ranks": [[0, 1]],
                                       "replicated_modules": ["h"], "replicated_module_count": 1},
                                hosts_by_rank=["a", "b"], profiled=True,
                                phase_ms_by_rank=[phase_stats([10.0]), phase_stats([11.0])],
                                audit_by_rank=[{"rows_checked": 3, "above_share": []}] * 2,
                                rounds_planned=3, injected_faults={"DSPARK_BENCH_SLOW_RANK": "1:5"})
    for f in fields(Measurement):  # the fixture must exercise every field, or the test proves less
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        assert getattr(original, f.name) != default, f.name
    ledger.append(original)
    assert ledger.measurements() == [original]


def test_update_delete_and_replace_are_refused(ledger: Ledger) -> None:
    ledger.append(make_measurement())
    conn = sqlite3.connect(ledger.path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("UPDATE measurements SET workload = 'tampered'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM measurements")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM schema_version")
    # SQLite resolves REPLACE by deleting the old row without firing delete triggers: before the
    # insert trigger, this overwrote a measurement silently.
    row = conn.execute("SELECT * FROM measurements").fetchone()
    for verb in ("INSERT OR REPLACE", "REPLACE"):
        with pytest.raises(sqlite3.DatabaseError, match=r"measurements.*INSERT OR REPLACE"):
            conn.execute(f"{verb} INTO measurements VALUES ({', '.join('?' * len(row))})",
                         (row[0], "new-id", *row[2:9], "tampered", *row[10:]))
        with pytest.raises(sqlite3.DatabaseError, match=r"measurements.*INSERT OR REPLACE"):
            conn.execute(f"{verb} INTO measurements VALUES ({', '.join('?' * len(row))})",
                         (None, row[1], *row[2:9], "tampered", *row[10:]))
    conn.close()
    assert [m.workload for m in ledger.measurements()] == ["gpt2-cpu"]
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        ledger.append(make_measurement())  # the same run, configuration and round again


def test_append_is_all_or_nothing_and_needs_provenance(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="run_id=''"):
        ledger.append([make_measurement(), make_measurement(run_id="")])
    with pytest.raises(ValueError, match="timestamp='yesterday'"):
        ledger.append(make_measurement(timestamp="yesterday"))
    with pytest.raises(TypeError, match="not a Measurement"):
        ledger.append([make_result()])  # type: ignore[list-item]
    assert ledger.measurements() == []


def test_schema_version_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with Ledger(path) as first:
        first.append(make_measurement())
        assert first.schema_version() == SCHEMA_VERSION == 4
    with Ledger(path) as again:  # reopening must not re-create or re-migrate
        assert len(again.measurements()) == 1
        assert again.schema_version() == SCHEMA_VERSION
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_version VALUES (?, 'future')", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="newer than this DSpark"):
        Ledger(path)


def test_a_schema_1_ledger_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_1)
    old = {**make_result(num_devices=2, step_ms=130.0, step_ms_p10=120.0, step_ms_p90=140.0,
                         run_id="r-old").to_dict(),
           "speedup": 9.9, "anomalies": [{"kind": "frozen", "message": "from an old rule"}],
           "config_hash": "abc", "replicated_inputs": [],
           "warmup_steps": 0, "measure_steps": 0}  # from before step counts were recorded
    conn.execute("INSERT INTO results (run_id, timestamp, git_commit, git_dirty, workload, "
                 "num_devices, strategy, precision, batch_placement, global_batch, config_hash, "
                 "result_json) VALUES (?, ?, ?, 0, ?, 2, ?, ?, ?, ?, ?, ?)",
                 ("r-old", old["timestamp"], old["git_commit"], old["workload"], old["strategy"],
                  old["precision"], old["batch_placement"], old["global_batch"], "abc",
                  json.dumps(old)))
    conn.commit()
    conn.close()
    with pytest.raises(LedgerUnsealed, match="--seal"):
        Ledger(path)   # no hash chain: never chained silently (see [Note: no silent seal])
    with Ledger(path, seal=True) as ledger:
        assert ledger.schema_version() == 4
        assert [seal.from_version for seal in ledger.seals()] == [1]
        (result,) = ledger.results()
    assert (result.step_ms, result.step_ms_p10, result.step_ms_p90) == (130.0, 120.0, 140.0)
    assert result.speedup is None and result.anomalies == []  # analysis is computed when read
    assert result.samples_by_rank == [128, 128] and result.step_ms_by_round == []
    with Ledger(path) as ledger:  # re-run with the default step counts
        assert ledger.stale("f" * 40, host="box")[0].measure_steps == 5
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("INSERT OR REPLACE INTO results SELECT * FROM results")
    conn.close()


def test_a_foreign_sqlite_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    with pytest.raises(ValueError, match="not a DSpark ledger"):
        Ledger(path)


def test_rounds_are_summarised_into_one_result(ledger: Ledger) -> None:
    ledger.append([make_measurement(round_index=r, step_ms_by_rank=[[100.0 + r, 90.0], [95.0, 120.0]],
                                    timestamp=f"2026-11-30T05:0{r}:00Z",
                                    **({} if r == 0 else {"batch": None, "state_held_by_rank": [],
                                                          "tensor_peak_bytes_by_rank": []}))
                   for r in range(3)])
    (result,) = ledger.results()
    assert result.rounds == 3 and result.round_indices == [0, 1, 2]
    assert result.step_ms_by_round == [[100.0, 120.0], [101.0, 120.0], [102.0, 120.0]]
    assert result.round_step_ms == [110.0, 110.5, 111.0]
    assert result.samples_by_rank == [4, 4] and result.peak_bytes_per_rank == 91_000_000
    assert result.model_state_parts["grads"] == [15_000_000, 15_000_000]
    assert result.result_id == f"run-a/{make_measurement().config.config_hash()}"
    assert result.timestamp == "2026-11-30T05:00:00Z"  # the first round's


def test_results_filter_by_prefix_oldest_first(ledger: Ledger) -> None:
    # Written out of order and with different UTC offsets: order follows the real time.
    late = make_measurement(run_id="20261130-b", git_commit=NEW, timestamp="2026-11-30T09:00:00+02:00")
    early = make_measurement(run_id="20261130-a", git_commit=OLD, timestamp="2026-11-30T06:30:00Z")
    ledger.append([late, early])
    assert [r.run_id for r in ledger.results()] == ["20261130-a", "20261130-b"]
    assert [r.run_id for r in ledger.results(run_id="20261130-b")] == ["20261130-b"]
    assert [r.run_id for r in ledger.results(commit="bbbbbbb")] == ["20261130-b"]
    assert ledger.results(run_id="2026113_") == []  # '_' is literal, not a wildcard


def test_runs_summarise_each_invocation(ledger: Ledger) -> None:
    ledger.append([make_measurement(run_id="r1", timestamp="2026-11-30T01:00:00Z"),
                   make_measurement(run_id="r1", round_index=1, timestamp="2026-11-30T01:01:00Z"),
                   make_measurement(run_id="r1", workload="resnet50-cpu", config_hash="h2",
                                    git_dirty=True, timestamp="2026-11-30T01:02:00Z"),
                   make_measurement(run_id="r2", git_commit=NEW, host="gpu-box",
                                    timestamp="2026-11-30T02:00:00Z")])
    runs = ledger.runs()
    assert [(r.run_id, r.num_results, r.workloads, r.git_dirty, r.hosts) for r in runs] == [
        ("r1", 2, ("gpt2-cpu", "resnet50-cpu"), True, ("box",)),
        ("r2", 1, ("gpt2-cpu",), False, ("gpu-box",))]


def test_previous_is_the_latest_earlier_result_of_the_same_key_on_the_same_host(
        ledger: Ledger) -> None:
    ledger.append([make_measurement(run_id=f"run-{i}", timestamp=f"2026-11-30T0{i}:00:00Z")
                   for i in range(1, 4)])
    ledger.append(make_measurement(run_id="elsewhere", host="gpu-box", timestamp="2026-11-30T04:00:00Z"))
    first, second, third, _ = ledger.results()
    assert ledger.previous(third).run_id == second.run_id  # type: ignore[union-attr]
    assert ledger.previous(first) is None
    fresh = make_result(**{**third.to_dict(), "run_id": "run-9", "timestamp": "2026-11-30T09:00:00Z"})
    assert ledger.previous(fresh).run_id == "run-3"  # type: ignore[union-attr]


def test_stale_is_other_code_on_this_host_only(ledger: Ledger) -> None:
    def at(workload: str, commit: str, hour: int, **kw: object) -> Measurement:
        return make_measurement(workload=workload, git_commit=commit, run_id=f"r{hour}",
                                config_hash=f"{workload}-{hour}",
                                timestamp=f"2026-11-30T{hour:02d}:00:00Z", **kw)

    ledger.append([
        at("old-commit", OLD, 1, warmup_steps=4, measure_steps=11),   # stale
        at("fresh", NEW, 2),                                          # fresh
        at("dirty", NEW, 3, git_dirty=True),                          # stale: dirty tree
        at("regressed-to-old", NEW, 4), at("regressed-to-old", OLD, 5),  # latest is old: stale
        at("rerun", OLD, 6), at("rerun", NEW, 7),                     # latest is new: fresh
        at("8-gpus", OLD, 8, host="gpu-box", num_devices=8),          # another host: never here
        at("fresh", OLD, 9, host="gpu-box"),                          # its latest elsewhere
    ])
    stale = ledger.stale(NEW[:12], host="box")  # an abbreviated commit is the same commit
    assert [c.workload for c in stale] == ["dirty", "old-commit", "regressed-to-old"]
    assert stale[1] == BenchConfig(workload="old-commit", num_devices=2, strategy="replicate",
                                   precision="bf16", global_batch=8, warmup_steps=4,
                                   measure_steps=11)
    assert {c.workload for c in ledger.stale(OLD, host="box")} == {"fresh", "dirty", "rerun"}
    # Uncommitted code now: every configuration this host measured, and none of another host's.
    assert len(ledger.stale(NEW, host="box", current_dirty=True)) == 5
    assert [c.workload for c in ledger.stale(NEW, host="gpu-box")] == ["8-gpus", "fresh"]
    with pytest.raises(ValueError, match="current_commit=''"):
        ledger.stale("", host="box")
    with pytest.raises(ValueError, match="host=''"):
        ledger.stale(NEW, host="")


def test_resolve_run_commit_latest_previous(ledger: Ledger) -> None:
    def at(run_id: str, commit: str, hour: int, ms: float, **kw: object) -> Measurement:
        return make_measurement(run_id=run_id, git_commit=commit, step_ms_by_rank=[[ms], [ms]],
                                measure_steps=1, timestamp=f"2026-11-30T0{hour}:00:00Z", **kw)

    ledger.append([at("20261130T01-aa", OLD, 1, 250.0), at("20261130T02-bb", NEW, 2, 240.0),
                   at("20261130T03-cc", NEW, 3, 230.0),
                   at("20261130T03-cc", NEW, 4, 130.0, workload="resnet50-cpu", config_hash="two")])
    assert [r.step_ms for r in ledger.resolve("latest")] == [230.0, 130.0]
    assert [r.step_ms for r in ledger.resolve("previous")] == [240.0]
    assert [r.step_ms for r in ledger.resolve("20261130T01")] == [250.0]
    # A commit measured twice: its newest run, whole.
    assert [r.step_ms for r in ledger.resolve("bbbbbbb")] == [230.0, 130.0]
    assert [r.step_ms for r in ledger.resolve(OLD)] == [250.0]
    with pytest.raises(ValueError, match=r"ref='2026'.*3 runs.*20261130T01-aa, 20261130T02-bb"):
        ledger.resolve("2026")
    with pytest.raises(ValueError) as unknown:
        ledger.resolve("zzz")
    assert_names(str(unknown.value), "ref='zzz'", "'latest'", "'previous'", "20261130T01-aa")


def test_a_commit_resolves_to_its_newest_run_only(ledger: Ledger) -> None:
    # The finding: a report "at a commit" took the newest result of each configuration, so a
    # later run of DSpark alone was paired with the earlier run's DDP.
    def at(run_id: str, strategy: str, hour: int) -> Measurement:
        return make_measurement(run_id=run_id, strategy=strategy, git_commit=NEW,
                                timestamp=f"2026-11-30T0{hour}:00:00Z")

    ledger.append([at("peers-run", "replicate", 1), at("peers-run", "torch-ddp", 1),
                   at("dspark-again", "replicate", 2)])
    chosen = ledger.resolve(NEW[:7])
    assert {r.run_id for r in chosen} == {"dspark-again"}
    assert [r.strategy for r in chosen] == ["replicate"]


def test_resolve_ambiguous_commit_and_empty_ledger(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="holds 0 run"):
        ledger.resolve("latest")
    ledger.append(make_measurement(run_id="x", git_commit="abc1234000"))
    with pytest.raises(ValueError, match=r"'previous'.*holds 1 run"):
        ledger.resolve("previous")
    ledger.append(make_measurement(run_id="y", git_commit="abc1234999"))
    with pytest.raises(ValueError, match=r"ref='abc1234'.*2 commits.*abc1234000, abc1234999"):
        ledger.resolve("abc1234")
    with pytest.raises(ValueError, match="ref='' is empty"):
        ledger.resolve("")


def test_default_db_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSPARK_LEDGER", str(tmp_path / "mine.sqlite"))
    assert default_db_path() == tmp_path / "mine.sqlite"
    monkeypatch.delenv("DSPARK_LEDGER")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_db_path() == tmp_path / "xdg" / "dspark" / "ledger.sqlite"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / ".local" / "share" / "dspark" / "ledger.sqlite"


def test_the_ledger_keeps_the_breakdown_and_reads_rows_written_before_it(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    new = make_measurement(profiled=True, hosts_by_rank=["a", "b"],
                           phase_ms_by_rank=[phase_stats([10.0]), phase_stats([11.0])],
                           audit_by_rank=[{"rows_checked": 3, "above_share": []}] * 2)
    old = make_measurement(run_id="run-old", timestamp="2026-11-29T05:00:00+00:00")
    with Ledger(db) as ledger:
        ledger.append(new)
        schema = ledger.schema_version()
    # A row as the code before the breakdown wrote it: its JSON has none of the new keys.
    text = json.dumps({k: v for k, v in old.to_dict().items()
                       if k not in ("hosts_by_rank", "profiled", "phase_ms_by_rank",
                                    "audit_by_rank")}, sort_keys=True)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(insert_measurement_sql(), (*measurement_row(old)[:-1], text, None, None))
    conn.close()
    with Ledger(db) as ledger:
        assert ledger.schema_version() == schema == 4
        before, after = annotate(ledger.results(), history=ledger)
    assert before.run_id == "run-old" and not before.profiled and before.phase_ms_by_rank == []
    assert before.hosts_by_rank == [] and before.audit_by_rank == []
    assert after.profiled and after.hosts_by_rank == ["a", "b"]
    assert [p["compute_ms"] for p in after.phase_ms_by_rank] == [10.0, 11.0]
    assert after.audit_by_rank == [{"rows_checked": 3, "above_share": []}] * 2
