"""The off_plan rule on synthetic results (pure logic): the seed's replicated runs are off their
plan, naming the activations; a healthy run is on it; the prediction is stored beside the run."""

from __future__ import annotations

import dataclasses

from dspark.bench.analyse.analysis import annotate
from dspark.bench.analyse.off_plan import off_plan, plan_for_result, predicted_fields
from tests.bench.factory import MB, MODEL_STATE_BYTES, make_result, seed_results


def test_the_seed_replicated_run_is_off_plan_by_its_activations_and_its_step() -> None:
    one, bug, fixed = seed_results()
    found = off_plan(bug, one)
    assert {a["kind"] for a in found} == {"off_plan"}
    peak = next(a for a in found if "measured_peak_bytes" in a)
    assert peak["part"] == "activations"
    assert "activations 2.0x the plan" in peak["message"]
    step = next(a for a in found if "measured_step_ms" in a)
    assert step["measured_step_ms"] / step["predicted_step_ms"] > 1.5
    assert off_plan(fixed, one) == []


def test_annotate_stores_the_plan_beside_the_measurement_and_flags_only_the_bug() -> None:
    annotated = {r.batch_placement + str(r.num_devices): r for r in annotate(seed_results())}
    healthy, bug = annotated["shard2"], annotated["replicate2"]
    assert healthy.predicted_step_ms is not None and healthy.predicted_peak_bytes_per_rank is not None
    # a 1/2 share of the activations on top of resnet50's exact AdamW state (25,557,032 params)
    assert abs(healthy.predicted_peak_bytes_per_rank - (16 * 25_557_032 + 1000 * MB)) < 5 * MB
    assert not [a for a in healthy.anomalies if a["kind"] == "off_plan"]
    assert [a for a in bug.anomalies if a["kind"] == "off_plan"]
    assert annotated["shard1"].predicted_step_ms is None  # the baseline plans nothing for itself


def test_the_step_names_the_phase_off_plan_when_profiled() -> None:
    one = make_result(phase_ms_by_rank=[{"forward_ms": 80.0, "backward_ms": 160.0, "optimizer_ms": 5.0,
                                         "comm_exposed_ms": 0.0, "step_ms": 245.0}])
    slow = make_result(num_devices=2, step_ms=300.0,
                       phase_ms_by_rank=[{"forward_ms": 40.0, "backward_ms": 80.0, "optimizer_ms": 5.0,
                                          "comm_exposed_ms": 170.0, "step_ms": 300.0}] * 2)
    found = off_plan(slow, one)
    assert len(found) == 1 and found[0]["part"] == "exposed communication", found


def test_no_plan_without_a_baseline_a_known_workload_or_a_dspark_strategy() -> None:
    one, _, fixed = seed_results()
    assert plan_for_result(fixed, None) is None
    assert plan_for_result(dataclasses.replace(fixed, workload="mystery"), one) is None
    assert plan_for_result(dataclasses.replace(fixed, strategy="ddp"), one) is None
    assert predicted_fields(fixed, None) == {"predicted_peak_bytes_per_rank": None,
                                              "predicted_step_ms": None}
    assert MODEL_STATE_BYTES > 0
