from __future__ import annotations

import copy
from pathlib import Path

import pytest

from dspark.bench.analysis import annotate, efficiency, find_baseline, speedup
from dspark.bench.ledger import Ledger
from tests.bench.factory import kinds, make_result, seed_results


@pytest.mark.parametrize(("workload", "one_ms", "bug_ms", "fixed_ms"), [
    ("resnet50", 245.0, 280.0, 130.0),
    ("gpt2-124m", 520.0, 610.0, 270.0),
])
def test_seed_table_replicated_flagged_sharded_healthy(workload: str, one_ms: float,
                                                       bug_ms: float, fixed_ms: float) -> None:
    one, bug, fixed = annotate(seed_results(workload, one_ms, bug_ms, fixed_ms))
    assert (one.speedup, one.efficiency) == (1.0, 1.0)
    assert fixed.speedup == pytest.approx(one_ms / fixed_ms)
    assert fixed.efficiency == pytest.approx(one_ms / fixed_ms / 2)
    assert bug.speedup == pytest.approx(one_ms / bug_ms)
    assert kinds(bug) == ["negative_scaling", "replicated_batch"]
    assert kinds(fixed) == [] and kinds(one) == []


def test_healthy_sharded_run_is_not_flagged() -> None:
    results = annotate([make_result(), make_result(num_devices=2, step_ms=245.0 / 1.8)])
    assert results[1].speedup == pytest.approx(1.8)
    assert [kinds(r) for r in results] == [[], []]


def test_annotate_copies_and_is_idempotent() -> None:
    results = seed_results()
    results[1].anomalies.append({"kind": "runner_note", "message": "kept"})
    before = copy.deepcopy(results)
    once = annotate(results)
    assert results == before  # the input is untouched
    twice = annotate(once)
    assert [kinds(r) for r in twice] == [kinds(r) for r in once]
    assert kinds(twice[1]) == ["runner_note", "negative_scaling", "replicated_batch"]


def test_no_baseline_leaves_speedup_unset() -> None:
    (alone,) = annotate([make_result(num_devices=2)])
    assert alone.speedup is None and alone.efficiency is None
    assert find_baseline(alone, [alone]) is None


def test_baseline_and_regression_from_history(tmp_path: Path) -> None:
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.append(annotate([make_result(run_id="old"),
                                make_result(run_id="old", num_devices=2, step_ms=130.0)]))
        new = make_result(run_id="new", num_devices=2, step_ms=160.0,
                          timestamp="2026-11-30T06:00:00+00:00")
        (annotated,) = annotate([new], history=ledger)
        assert annotated.speedup == pytest.approx(245.0 / 160.0)
        assert kinds(annotated) == ["regression"]
        assert annotated.anomalies[0]["previous_step_ms"] == 130.0
        # Re-annotating without a history keeps the regression found with one.
        assert kinds(annotate([annotated])[0]) == ["regression"]


def test_speedup_and_efficiency_helpers() -> None:
    assert speedup(make_result(num_devices=2, step_ms=122.5), make_result()) == 2.0
    assert efficiency(1.88, 2) == pytest.approx(0.94)
    with pytest.raises(ValueError, match=r"step_ms=0\.0"):
        speedup(make_result(step_ms=0.0), make_result())
