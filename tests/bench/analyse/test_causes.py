"""negative_scaling names the cause that accounts for the lost time, with the numbers, or says
that none does; each finding that blamed communication wrongly is reproduced first."""

from __future__ import annotations

import dataclasses

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.analyse.causes import lost_ms, negative_scaling, ranked_causes
from dspark.bench.result import BenchResult
from tests.bench.factory import MB, MODEL_STATE_BYTES, make_result, phase_stats, seed_results
from tests.messages import assert_line_names


def _scaled(result: BenchResult, baseline: BenchResult) -> BenchResult:
    return annotate([baseline, result])[1]


def test_the_seed_bug_is_blamed_on_its_replicated_batch() -> None:
    one, bug, fixed = seed_results()
    (found,) = negative_scaling(_scaled(bug, one), one)
    assert found["message"].startswith("2 devices "), found["message"]
    assert_line_names(found["message"], "1.14x slower", "280 ms", "245 ms", "3 rounds",
                      "0.88x-0.88x")
    assert found["causes"][0]["kind"] == "replicated_batch" and found["accounted"]
    assert_line_names(found["message"], "likely cause", "replicated batch")
    assert found["speedup"] == pytest.approx(245 / 280)
    assert negative_scaling(_scaled(fixed, one), one) == []
    assert negative_scaling(one, one) == []
    assert negative_scaling(bug, None) == []


def test_a_slowed_rank_is_the_cause_not_its_communication() -> None:
    # The finding: rank 1 slowed on purpose (flagged straggler at 2.11x compute) and the cause
    # given was "communication (9.33 ms per step)".
    one = make_result(step_ms=300.0)
    slowed = make_result(num_devices=2, step_ms=330.0, round_step_ms=[330.0] * 3,
                         phase_ms_by_rank=[{"compute_ms": 150.0, "comm_exposed_ms": 170.0},
                                           {"compute_ms": 316.0, "comm_exposed_ms": 9.33}],
                         profiled=True)
    scaled = _scaled(slowed, one)
    assert lost_ms(scaled, one) == pytest.approx(180.0)
    causes = ranked_causes(scaled, one)
    assert [c.kind for c in causes][:1] == ["straggler"]
    assert causes[0].ms == pytest.approx(166.0)
    (found,) = negative_scaling(scaled, one)
    assert found["accounted"] and found["causes"][0]["kind"] == "straggler"
    assert_line_names(found["message"], "likely cause", "straggler", "166 ms per step", "rank 1",
                      "316 ms")


def test_a_busy_machine_is_weighed_against_the_communication_it_dwarfs() -> None:
    # The finding: 4.44 ms of communication blamed for an 801 ms step flagged busy_machine.
    one = make_result(step_ms=463.0, core_foreign_share_by_round=[0.01] * 3)
    busy = make_result(num_devices=2, step_ms=801.0, round_step_ms=[801.0] * 3,
                       core_foreign_share_by_round=[0.62, 0.55, 0.60],
                       comm_wire_bytes_per_step=int(44.4 * MB), bus_bytes_per_s=10e9)
    scaled = _scaled(busy, one)
    (found,) = negative_scaling(scaled, one)
    kinds = [c["kind"] for c in found["causes"]]
    assert kinds == ["busy_machine", "communication"]
    assert found["causes"][0]["ms"] == pytest.approx(0.62 * 801.0)
    assert found["accounted"] and "likely cause: busy machine" in found["message"]
    assert_line_names(found["message"], "also measured", "communication", "4.44 ms per step")


def test_when_no_cause_accounts_for_the_loss_it_says_so_with_the_numbers() -> None:
    one = make_result()
    mixed = _scaled(make_result(num_devices=2, step_ms=250.0, round_step_ms=[250.0, 240.0, 260.0]),
                    one)
    (found,) = negative_scaling(mixed, one)
    assert_line_names(found["message"], "no slower", "no faster than 1")
    assert not found["accounted"] and found["lost_ms"] == pytest.approx(250.0 - 122.5)
    assert_line_names(found["message"], "none", "128 ms lost per step")
    assert_line_names(found["message"], "communication", "10.2 ms per step", "102.0 MB")
    assert "--profile" in found["message"]
    bare = dataclasses.replace(mixed, comm_wire_bytes_per_step=0, core_foreign_share_by_round=[])
    (found,) = negative_scaling(bare, one)
    assert found["causes"] == [] and "nothing measured accounts for" in found["message"]


def test_extra_model_state_is_still_named() -> None:
    one = make_result(strategy="zero2")
    state = make_result(num_devices=2, step_ms=300.0, strategy="zero2",
                        model_state_bytes_expected_per_rank=MODEL_STATE_BYTES // 2)
    (found,) = negative_scaling(_scaled(state, one), one)
    assert_line_names(found["message"], "more model state", "zero2")


def test_profiled_communication_is_the_exposed_wait() -> None:
    one = make_result(step_ms=200.0)
    waiting = make_result(num_devices=2, step_ms=260.0, round_step_ms=[260.0] * 3,
                          core_foreign_share_by_round=[0.0] * 3, profiled=True,
                          phase_ms_by_rank=[{"compute_ms": 100.0, **{k: v[0] for k, v in
                                                                    phase_stats([100.0], 150.0).items()
                                                                    if k != "compute_ms"}}] * 2)
    (found,) = negative_scaling(_scaled(waiting, one), one)
    assert found["causes"][0] == {"kind": "communication", "ms": 150.0} and found["accounted"]
