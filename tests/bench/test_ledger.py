from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from dspark.bench.ledger import SCHEMA_VERSION, Ledger, default_db_path
from dspark.bench.result import BenchConfig, BenchResult
from tests.bench.factory import make_result

OLD = "aaaaaaa1111111111111111111111111111111111"
NEW = "bbbbbbb2222222222222222222222222222222222"


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(tmp_path / "deep" / "dir" / "ledger.sqlite") as opened:
        yield opened


def _every_field_set() -> BenchResult:
    return make_result(
        workload="gpt2-124m", num_devices=2, strategy="zero2", precision="bf16",
        batch_placement="replicate", global_batch=64, step_ms=12.5, step_ms_p10=11.0,
        step_ms_p90=14.0, samples_per_s=5120.0, peak_bytes_per_rank=123_456_789,
        model_state_bytes_per_rank=98_765_432, local_batch=64,
        model_state_bytes_expected_per_rank=55_555_555, replicated_inputs=["batch[0]"],
        model_state_parts={"params": [1, 2], "grads": [3, 4], "optimizer": [5, 6]},
        comm_bytes_per_step=4321, comm_wire_bytes_per_step=8642, bus_bytes_per_s=1.5e9,
        speedup=0.87, efficiency=0.435,
        anomalies=[{"kind": "negative_scaling", "message": "slow", "speedup": 0.87}],
        git_commit=NEW, git_dirty=True, dspark_version="0.1.0", torch_version="2.13.0",
        python_version="3.11.7", host="box", device_model="cpu", backend="gloo",
        config_hash="abcdef0123456789", timestamp="2026-11-30T07:16:56+02:00",
        run_id="run-roundtrip", warmup_steps=3, measure_steps=9)


def test_round_trip_keeps_every_field(ledger: Ledger) -> None:
    original = _every_field_set()
    for f in fields(BenchResult):  # the fixture must exercise every field, or the test proves less
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        assert getattr(original, f.name) != default, f.name
    ledger.append([original])
    (loaded,) = ledger.results()
    assert loaded == original
    assert loaded.to_dict() == original.to_dict()


def test_update_and_delete_are_refused(ledger: Ledger) -> None:
    ledger.append([make_result()])
    conn = sqlite3.connect(ledger.path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("UPDATE results SET workload = 'tampered'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM results")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM schema_version")
    conn.close()
    assert [r.workload for r in ledger.results()] == ["resnet50"]


def test_append_is_all_or_nothing_and_needs_provenance(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="run_id=''"):
        ledger.append([make_result(), make_result(run_id="")])
    with pytest.raises(ValueError, match="timestamp='yesterday'"):
        ledger.append([make_result(timestamp="yesterday")])
    with pytest.raises(TypeError, match="not a BenchResult"):
        ledger.append([make_result().to_dict()])  # type: ignore[list-item]
    assert ledger.results() == []


def test_schema_version_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with Ledger(path) as first:
        first.append([make_result()])
        assert first.schema_version() == SCHEMA_VERSION
    with Ledger(path) as again:  # reopening must not re-create or re-migrate
        assert len(again.results()) == 1
        assert again.schema_version() == SCHEMA_VERSION
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_version VALUES (?, 'future')", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match="newer than this DSpark"):
        Ledger(path)


def test_results_filter_by_prefix_oldest_first(ledger: Ledger) -> None:
    # Written out of order and with different UTC offsets: order follows the real time.
    late = make_result(run_id="20261130-b", git_commit=NEW, timestamp="2026-11-30T09:00:00+02:00")
    early = make_result(run_id="20261130-a", git_commit=OLD, timestamp="2026-11-30T06:30:00Z")
    ledger.append([late, early])
    assert [r.run_id for r in ledger.results()] == ["20261130-a", "20261130-b"]
    assert [r.run_id for r in ledger.results(run_id="20261130-b")] == ["20261130-b"]
    assert [r.run_id for r in ledger.results(commit="bbbbbbb")] == ["20261130-b"]
    assert ledger.results(run_id="20261130", commit="aaaa")[0].run_id == "20261130-a"
    assert ledger.results(run_id="2026113_") == []  # '_' is literal, not a wildcard


def test_runs_summarise_each_invocation(ledger: Ledger) -> None:
    ledger.append([make_result(run_id="r1", workload="resnet50", timestamp="2026-11-30T01:00:00Z"),
                   make_result(run_id="r1", workload="gpt2", num_devices=2, git_dirty=True,
                               timestamp="2026-11-30T01:01:00Z"),
                   make_result(run_id="r2", git_commit=NEW, timestamp="2026-11-30T02:00:00Z")])
    runs = ledger.runs()
    assert [(r.run_id, r.num_results, r.workloads, r.git_dirty) for r in runs] == [
        ("r1", 2, ("gpt2", "resnet50"), True), ("r2", 1, ("resnet50",), False)]
    assert runs[1].git_commit == NEW


def _series(ledger: Ledger) -> list[BenchResult]:
    results = [make_result(run_id=f"run-{i}", step_ms=200.0 + i,
                           timestamp=f"2026-11-30T0{i}:00:00Z") for i in range(1, 4)]
    ledger.append(results)
    return results


def test_previous_is_the_latest_earlier_result_of_the_same_key(ledger: Ledger) -> None:
    first, second, third = _series(ledger)
    ledger.append([make_result(run_id="other", num_devices=2, timestamp="2026-11-30T02:30:00Z")])
    assert ledger.previous(third) == second
    assert ledger.previous(second) == first
    assert ledger.previous(first) is None
    # Not yet appended: everything recorded before it counts.
    fresh = make_result(run_id="run-9", timestamp="2026-11-30T09:00:00Z")
    assert ledger.previous(fresh) == third
    assert ledger.latest_by_key()[fresh.key] == third


def test_stale_picks_exactly_the_configs_not_measured_on_this_code(ledger: Ledger) -> None:
    def at(workload: str, commit: str, hour: int, **kw: object) -> BenchResult:
        return make_result(workload=workload, git_commit=commit, run_id=f"r{hour}",
                           timestamp=f"2026-11-30T{hour:02d}:00:00Z", **kw)

    ledger.append([
        at("old-commit", OLD, 1, warmup_steps=4, measure_steps=11),   # stale
        at("fresh", NEW, 2),                                          # fresh
        at("dirty", NEW, 3, git_dirty=True),                          # stale: dirty tree
        at("regressed-to-old", NEW, 4), at("regressed-to-old", OLD, 5),  # latest is old: stale
        at("rerun", OLD, 6), at("rerun", NEW, 7),                     # latest is new: fresh
        at("no-steps", OLD, 8, warmup_steps=0, measure_steps=0),      # stale, default steps
    ])
    stale = ledger.stale(NEW[:12])  # an abbreviated commit is the same commit
    assert [c.workload for c in stale] == ["dirty", "no-steps", "old-commit", "regressed-to-old"]
    by_name = {c.workload: c for c in stale}
    assert by_name["old-commit"] == BenchConfig(workload="old-commit", num_devices=1,
                                                strategy="replicate", precision="fp16",
                                                global_batch=256, warmup_steps=4,
                                                measure_steps=11)
    defaults = BenchConfig(workload="x", num_devices=1)
    assert by_name["no-steps"].measure_steps == defaults.measure_steps
    assert {c.workload for c in ledger.stale(OLD)} == {"fresh", "dirty", "rerun"}
    assert len(ledger.stale(NEW, current_dirty=True)) == 6  # uncommitted code: everything
    with pytest.raises(ValueError, match="current_commit=''"):
        ledger.stale("")


def test_resolve_run_commit_latest_previous(ledger: Ledger) -> None:
    ledger.append([make_result(run_id="20261130T01-aa", git_commit=OLD, step_ms=250.0,
                               timestamp="2026-11-30T01:00:00Z"),
                   make_result(run_id="20261130T02-bb", git_commit=NEW, step_ms=240.0,
                               timestamp="2026-11-30T02:00:00Z"),
                   make_result(run_id="20261130T03-cc", git_commit=NEW, step_ms=230.0,
                               timestamp="2026-11-30T03:00:00Z"),
                   make_result(run_id="20261130T03-cc", git_commit=NEW, num_devices=2,
                               step_ms=130.0, timestamp="2026-11-30T03:01:00Z")])
    assert [r.step_ms for r in ledger.resolve("latest")] == [230.0, 130.0]
    assert [r.step_ms for r in ledger.resolve("previous")] == [240.0]
    assert [r.step_ms for r in ledger.resolve("20261130T01")] == [250.0]
    assert [r.step_ms for r in ledger.resolve("20261130T03-cc")] == [230.0, 130.0]
    # A commit measured twice: the newest result of each configuration.
    assert [r.step_ms for r in ledger.resolve("bbbbbbb")] == [230.0, 130.0]
    assert [r.step_ms for r in ledger.resolve(OLD)] == [250.0]
    with pytest.raises(ValueError, match=r"matches 3 runs: 20261130T01-aa, 20261130T02-bb"):
        ledger.resolve("2026")
    with pytest.raises(ValueError, match=r"ref='zzz' is neither.*runs: 20261130T01-aa"):
        ledger.resolve("zzz")


def test_resolve_ambiguous_commit_and_empty_ledger(ledger: Ledger) -> None:
    with pytest.raises(ValueError, match="holds 0 run"):
        ledger.resolve("latest")
    ledger.append([make_result(run_id="x", git_commit="abc1234000")])
    with pytest.raises(ValueError, match=r"'previous'.*holds 1 run"):
        ledger.resolve("previous")
    ledger.append([make_result(run_id="y", git_commit="abc1234999")])
    with pytest.raises(ValueError, match="matches 2 commits: abc1234000, abc1234999"):
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
