"""run_suite's bookkeeping with the workers stubbed out: rounds, failures, the ledger."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from rich.console import Console

from dspark.bench.ledger.ledger import Ledger
from dspark.bench.measure import runner
from dspark.bench.measure.runner import (
    BenchRunError,
    RunFailure,
    describe_config,
    interleaved_plan,
    new_run_id,
    run_suite,
)
from dspark.bench.result import BenchConfig
from tests.bench.factory import FakeWorkers
from tests.messages import assert_line_names

ONE = BenchConfig(workload="gpt2-cpu", num_devices=1, global_batch=8, measure_steps=3)
TWO = dataclasses.replace(ONE, num_devices=2)
BUG = dataclasses.replace(TWO, batch_placement="replicate")
OTHER_ONE = dataclasses.replace(ONE, workload="resnet50-cpu")
OTHER_TWO = dataclasses.replace(OTHER_ONE, num_devices=2)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeWorkers:
    workers = FakeWorkers()
    monkeypatch.setattr(runner, "run_in_workers", workers)
    return workers


def test_rounds_alternate_baseline_and_n_devices() -> None:
    plan = interleaved_plan([TWO, BUG, ONE, OTHER_ONE, OTHER_TWO], 3)
    one, two, bug, o1, o2 = "gpt2 1", "gpt2 2", "gpt2 2 bug", "resnet 1", "resnet 2"
    names = {ONE: one, TWO: two, BUG: bug, OTHER_ONE: o1, OTHER_TWO: o2}
    assert [(r, names[c]) for r, c in plan] == [
        (0, one), (0, two), (0, bug), (0, o1), (0, o2),
        (1, two), (1, bug), (1, one), (1, o2), (1, o1),
        (2, bug), (2, one), (2, two), (2, o1), (2, o2)]
    with pytest.raises(ValueError, match="rounds=0"):
        interleaved_plan([ONE], 0)


def test_every_round_is_recorded_and_the_speedup_comes_from_them(fake: FakeWorkers,
                                                                  tmp_path: Path) -> None:
    results = run_suite([ONE, TWO], db=tmp_path / "l.sqlite", rounds=3, progress=False, run_id="r1")
    assert [(c.num_devices, r, probe) for c, r, probe in fake.calls] == [
        (1, 0, True), (2, 0, True), (2, 1, False), (1, 1, False), (1, 2, False), (2, 2, False)]
    one, two = results
    assert two.round_speedups == [200.0 / 100.0, 201.0 / 101.0, 202.0 / 102.0]
    assert two.baseline_result_id == one.result_id == f"r1/{ONE.config_hash()}"
    with Ledger(tmp_path / "l.sqlite") as ledger:
        assert len(ledger.measurements(run_id="r1")) == 6


def test_a_crash_mid_suite_keeps_the_finished_measurements(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    # Before: results were written only after the whole suite, so this lost everything.
    workers = FakeWorkers(crash_at=3)
    monkeypatch.setattr(runner, "run_in_workers", workers)
    console = Console(record=True, width=200)
    with pytest.raises(KeyboardInterrupt):
        run_suite([ONE, TWO], db=tmp_path / "l.sqlite", rounds=3, progress=False, run_id="r1",
                  console=console)
    with Ledger(tmp_path / "l.sqlite") as ledger:
        kept = ledger.measurements()
    assert [(m.num_devices, m.round_index) for m in kept] == [(1, 0), (2, 0), (2, 1)]
    # and the user is told the run is cut short, not left to read it as a whole one later
    assert_line_names(console.export_text(), "interrupted", "r1", "3 of", "6 planned")


def test_a_failure_is_reported_not_relaunched_and_the_rest_is_recorded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    workers = FakeWorkers(fail=TWO)
    monkeypatch.setattr(runner, "run_in_workers", workers)
    db = tmp_path / "ledger.sqlite"
    failures: list[RunFailure] = []
    results = run_suite([ONE, TWO], db=db, rounds=2, progress=False, run_id="r1",
                        failures=failures)
    assert [f.config for f in failures] == [TWO]
    assert [c.num_devices for c, _, _ in workers.calls] == [1, 2, 1]
    assert [(r.num_devices, r.rounds, r.speedup) for r in results] == [(1, 2, 1.0)]
    with pytest.raises(BenchRunError, match="gpt2-cpu, 2 devices") as caught:
        run_suite([ONE, TWO], db=db, rounds=1, progress=False)
    assert caught.value.failures[0].stderr_tail == "RuntimeError: boom"
    with Ledger(db) as ledger:
        assert len(ledger.results()) == 2


def test_progress_bar_runs(fake: FakeWorkers, tmp_path: Path) -> None:
    from rich.console import Console

    console = Console(record=True, width=120, force_terminal=False)
    run_suite([ONE], db=tmp_path / "l.sqlite", rounds=1, progress=True, console=console)
    assert "1 measured, 0 failed" in console.export_text()


def test_empty_suite_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to run"):
        run_suite([], db=tmp_path / "l.sqlite")


def test_labels_and_run_ids() -> None:
    assert describe_config(TWO) == "gpt2-cpu, 2 devices, replicate, bf16, batch 8 shard"
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", new_run_id())
    assert new_run_id() != new_run_id()


def test_profile_reaches_every_round_and_a_trace_only_each_first_one(fake: FakeWorkers,
                                                                      tmp_path: Path) -> None:
    run_suite([ONE, TWO], db=tmp_path / "l.sqlite", rounds=2, progress=False, profile=True,
              trace_root=tmp_path / "traces")
    assert [(c.num_devices, r) for c, r, _ in fake.calls] == [(1, 0), (2, 0), (2, 1), (1, 1)]
    assert all(options["profile"] for options in fake.options)
    assert [options["trace_dir"] for options in fake.options] == [
        tmp_path / "traces" / "gpt2-cpu-1dev-replicate-bf16-shard8",
        tmp_path / "traces" / "gpt2-cpu-2dev-replicate-bf16-shard8", None, None]


def test_an_injected_fault_is_recorded_shown_and_never_a_baseline(
        fake: FakeWorkers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The finding: DSPARK_BENCH_SLOW_RANK was recorded nowhere, and the slowed result became
    # ordinary history for later noise bands and regression checks.
    from dspark.bench.present.formatting import anomaly_kinds, config_label

    db = tmp_path / "ledger.sqlite"
    (clean,) = [r for r in run_suite([ONE], db=db, rounds=1, progress=False, run_id="clean")]
    monkeypatch.setenv("DSPARK_BENCH_SLOW_RANK", "1:100")
    (slowed,) = run_suite([ONE], db=db, rounds=1, progress=False, run_id="slowed")
    assert slowed.injected_faults == {"DSPARK_BENCH_SLOW_RANK": "1:100"}
    assert clean.injected_faults == {}
    assert "injected DSPARK_BENCH_SLOW_RANK=1:100" in anomaly_kinds(slowed)
    assert "injected DSPARK_BENCH_SLOW_RANK=1:100" in config_label(slowed)
    monkeypatch.delenv("DSPARK_BENCH_SLOW_RANK")
    (later,) = run_suite([ONE], db=db, rounds=1, progress=False, run_id="later")
    with Ledger(db) as ledger:
        asked = dataclasses.replace(later, timestamp="2099-01-01T00:00:00+00:00")
        assert ledger.previous(asked).run_id == "clean"  # never the slowed one
        assert [m.rounds_planned for m in ledger.measurements()] == [1, 1, 1]
        assert ledger.verify().ok
