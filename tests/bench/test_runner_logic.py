"""run_suite's bookkeeping with the workers stubbed out: failures, ledger, annotation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark.bench import runner
from dspark.bench.ledger import Ledger
from dspark.bench.result import BenchConfig, BenchResult
from dspark.bench.runner import (
    BenchRunError,
    RunFailure,
    busy_machine_anomalies,
    describe_config,
    new_run_id,
    run_suite,
)
from tests.bench.factory import make_result

GOOD = BenchConfig(workload="resnet50", num_devices=1, precision="fp16", global_batch=256)
BAD = BenchConfig(workload="resnet50", num_devices=2, precision="fp16", global_batch=256)


def _fake_workers(config: BenchConfig) -> BenchResult | RunFailure:
    if config == BAD:
        return RunFailure(config=config, exit_code=1, stderr_tail="RuntimeError: boom")
    return make_result(run_id="", timestamp="2026-11-30T06:00:00+00:00")


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "run_in_workers", _fake_workers)


def test_a_failure_is_reported_and_the_rest_is_recorded(stubbed: None, tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    failures: list[RunFailure] = []
    results = run_suite([BAD, GOOD], db=db, progress=False, run_id="r1", failures=failures)
    assert [f.config for f in failures] == [BAD]
    assert [r.num_devices for r in results] == [1]
    assert results[0].run_id == "r1" and results[0].speedup == 1.0  # annotated
    with Ledger(db) as ledger:
        assert [r.run_id for r in ledger.results()] == ["r1"]


def test_without_a_failures_list_a_failure_raises_after_recording(stubbed: None,
                                                                 tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    with pytest.raises(BenchRunError, match="resnet50, 2 devices") as caught:
        run_suite([GOOD, BAD], db=db, progress=False)
    assert caught.value.failures[0].stderr_tail == "RuntimeError: boom"
    with Ledger(db) as ledger:
        assert len(ledger.results()) == 1


def test_progress_bar_runs(stubbed: None, tmp_path: Path) -> None:
    from rich.console import Console

    console = Console(record=True, width=120, force_terminal=False)
    run_suite([GOOD], db=tmp_path / "l.sqlite", progress=True, console=console)
    assert "1 measured, 0 failed" in console.export_text()


def test_empty_suite_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to run"):
        run_suite([], db=tmp_path / "l.sqlite")


def test_labels_and_run_ids() -> None:
    assert describe_config(BAD) == "resnet50, 2 devices, replicate, fp16, batch 256 shard"
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", new_run_id())
    assert new_run_id() != new_run_id()


def test_busy_machine_is_flagged_above_the_allowance() -> None:
    assert busy_machine_anomalies(0.2, num_cores=2) == []
    [anomaly] = busy_machine_anomalies(0.9, num_cores=2)
    assert anomaly["kind"] == "busy_machine" and anomaly["foreign_cores"] == 0.9
    assert "0.90 of the machine's 2 cores" in anomaly["message"]
    assert busy_machine_anomalies(3.0, num_cores=64) == []  # background load on a big box
