from __future__ import annotations

import copy
from pathlib import Path

import pytest

from dspark.bench.analyse.analysis import annotate, find_baseline, scaling
from dspark.bench.ledger.ledger import Ledger
from tests.bench.factory import kinds, make_measurement, make_result, seed_results
from tests.messages import assert_line_names


@pytest.mark.parametrize(("workload", "one_ms", "bug_ms", "fixed_ms"), [
    ("resnet50", 245.0, 280.0, 130.0),
    ("gpt2-124m", 520.0, 610.0, 270.0),
])
def test_seed_table_replicated_flagged_sharded_healthy(workload: str, one_ms: float,
                                                       bug_ms: float, fixed_ms: float) -> None:
    one, bug, fixed = annotate(seed_results(workload, one_ms, bug_ms, fixed_ms))
    assert (one.speedup, one.efficiency) == (1.0, 1.0)
    assert bug.speedup is not None and bug.speedup < 1 < fixed.speedup  # type: ignore[operator]
    # off_plan on its step, and on its peak (the activations) where the factory's model state is
    # resnet50's real one (gpt2-124m's real state, 2 GB, is above the factory's 400 MB)
    assert kinds(bug)[:3] == ["negative_scaling", "replicated_batch", "off_plan"]
    assert kinds(fixed) == [] and kinds(one) == []
    assert fixed.baseline_result_id == bug.baseline_result_id == one.result_id


def test_speedup_is_the_median_of_per_round_ratios_not_a_ratio_of_medians() -> None:
    # Round 1 of both was slow (a busy spell): per round the ratios are 2.0, 2.0 and 1.25.
    # The median of the round medians would give 100 / 80 = 1.25; pooling gives yet another figure.
    one = make_result(round_step_ms=[100.0, 200.0, 100.0], step_ms=100.0)
    two = make_result(num_devices=2, round_step_ms=[50.0, 100.0, 80.0], step_ms=80.0)
    _, annotated = annotate([one, two])
    assert annotated.round_speedups == [2.0, 2.0, 1.25]
    assert (annotated.speedup, annotated.speedup_min, annotated.speedup_max) == (2.0, 1.25, 2.0)
    assert annotated.efficiency == 1.0


def test_rounds_are_paired_by_index() -> None:
    one = make_result(round_indices=[0, 2], round_step_ms=[100.0, 300.0])  # round 1 failed
    two = make_result(num_devices=2, round_indices=[0, 1, 2], round_step_ms=[50.0, 10.0, 100.0])
    found = scaling(two, one)
    assert found is not None and found.round_speedups == (2.0, 3.0)
    assert scaling(two, make_result(round_indices=[5], round_step_ms=[100.0])) is None


def test_a_baseline_from_another_run_is_never_used(tmp_path: Path) -> None:
    # Before: the ledger's latest 1-device row of any run, commit or host stood in for a missing
    # baseline, and which one was not recorded.
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.append(make_measurement(num_devices=1, run_id="old", config_hash="one",
                                       step_ms_by_rank=[[200.0, 200.0, 200.0]]))
        alone = make_result(workload="gpt2-cpu", precision="bf16", global_batch=8, num_devices=2,
                            run_id="new", timestamp="2026-11-30T06:00:00+00:00")
        (annotated,) = annotate([alone], history=ledger)
    assert annotated.speedup is None and annotated.baseline_result_id is None
    assert find_baseline(alone, [make_result(run_id="other")]) is None


def test_superlinear_speedup_is_flagged_as_a_suspect_baseline() -> None:
    one = make_result(round_step_ms=[300.0, 280.0, 290.0], core_foreign_share_by_round=[0.3, 0.01, 0.2])
    two = make_result(num_devices=2, round_step_ms=[125.0, 126.0, 124.0], step_ms=125.0)
    _, annotated = annotate([one, two])
    assert annotated.speedup is not None and annotated.speedup > 2
    assert kinds(annotated) == ["suspect_baseline"]
    message = annotated.anomalies[0]["message"]
    assert message.startswith("2 devices "), message
    assert_line_names(message, "round 0: 2.40x", "round 1: 2.22x", "median 2.34x", "above the 2x")
    assert_line_names(message, "core", "30%", "other processes")
    assert annotated.anomalies[0]["baseline_result_id"] == one.result_id


def test_annotate_copies_recomputes_and_is_idempotent() -> None:
    results = seed_results()
    results[1].anomalies.append({"kind": "frozen_by_an_old_version", "message": "stale"})
    before = copy.deepcopy(results)
    once = annotate(results)
    assert results == before  # the input is untouched
    assert kinds(once[1]) == ["negative_scaling", "replicated_batch", "off_plan", "off_plan"]  # rules are the truth
    assert annotate(once) == once


def test_regression_against_history_uses_the_noise_model(tmp_path: Path) -> None:
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        ledger.append(make_measurement(run_id="old", step_ms_by_rank=[[100.0] * 3, [100.0] * 3]))
        (same,) = ledger.results()
        slower = make_result(**{**same.to_dict(), "run_id": "new", "result_id": "new/x",
                                "timestamp": "2026-11-30T06:00:00+00:00", "step_ms": 120.0,
                                "step_ms_p10": 119.0, "step_ms_p90": 121.0,
                                "round_step_ms": [120.0] * 3, "round_indices": [0, 1, 2],
                                "anomalies": []})
        (flagged,) = annotate([slower], history=ledger)
        assert kinds(flagged) == ["regression"]
        assert flagged.anomalies[0]["noise_band"] == pytest.approx(0.15)  # no history: the default
        within = make_result(**{**slower.to_dict(), "step_ms": 112.0, "round_step_ms": [112.0] * 3})
        assert kinds(annotate([within], history=ledger)[0]) == []
