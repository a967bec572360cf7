"""The step breakdown in the lab (`dspark bench --profile`) and the straggler rule, on synthetic
measurements and results: no process group."""

from __future__ import annotations

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.analyse.breakdown import PHASE_KEYS, compute_band, step_breakdown, straggler
from dspark.bench.analyse.noise import DEFAULT_RUN_TO_RUN
from dspark.bench.ledger.measurement import results_from_measurements
from tests.bench.factory import kinds, make_measurement, phase_stats, profiled_result
from tests.messages import assert_line_names


def test_rounds_pool_into_one_median_per_rank_and_phase() -> None:
    rounds = [make_measurement(round_index=i, profiled=True, hosts_by_rank=["a", "b"],
                               phase_ms_by_rank=[phase_stats([10.0 + i, 12.0]), phase_stats([20.0, 22.0 + i])])
              for i in range(2)]
    result = results_from_measurements(rounds)[0]
    assert result.profiled and result.hosts_by_rank == ["a", "b"]
    assert [tuple(p) for p in result.phase_ms_by_rank] == [PHASE_KEYS, PHASE_KEYS]
    assert result.phase_ms_by_rank[0]["compute_ms"] == 11.5  # median of 10, 12, 11, 12
    assert result.phase_ms_by_rank[1]["compute_ms"] == 21.0  # median of 20, 22, 20, 23
    assert result.phase_ms_by_rank[0]["comm_exposed_ms"] == 2.0
    low, high = result.compute_ms_range_by_rank[1]
    assert 20.0 <= low < high <= 23.0


def test_unprofiled_and_peer_results_have_no_breakdown() -> None:
    plain = results_from_measurements([make_measurement()])[0]
    assert not plain.profiled and plain.phase_ms_by_rank == []
    peer = results_from_measurements([make_measurement(strategy="torch-ddp", profiled=True,
                                                       hosts_by_rank=["box", "box"])])[0]
    assert peer.profiled and peer.phase_ms_by_rank == []
    assert straggler(peer) == [] and step_breakdown([]) == {
        "profiled": False, "phase_ms_by_rank": [], "compute_ms_range_by_rank": []}


def test_a_slow_rank_is_named_with_its_host_and_numbers() -> None:
    result = profiled_result([[30.0, 31.0, 30.5], [130.0, 131.0, 130.5]], waits=[100.0, 1.0])
    [found] = straggler(result)
    assert found["kind"] == "straggler" and found["rank"] == 1 and found["host"] == "box1"
    assert found["compute_ms"] == 130.5 and found["others_compute_ms"] == 30.5
    assert found["noise_band"] == DEFAULT_RUN_TO_RUN
    assert "15% default" in found["noise_band_source"]  # the message says where its band came from
    assert found["message"].startswith("rank 1 on host box1 "), found["message"]
    assert_line_names(found["message"], "130 ms per step", "waits excluded", "4.28x", "30.5 ms",
                      "noise band of 15%", "15% default")
    assert_line_names(found["message"], "others wait", "100 ms per step", "its own", "1.00 ms")
    assert "busy_machine" not in kinds(annotate([result])[0]) and "straggler" in kinds(annotate([result])[0])


def test_healthy_ranks_within_the_noise_band_are_not_flagged() -> None:
    # 12% apart: inside the machine's 15% run-to-run range.
    assert straggler(profiled_result([[100.0, 101.0, 99.0], [112.0, 113.0, 111.0]])) == []
    # 40% apart, but rank 0's own steps wander by more than that: no evidence.
    wandering = profiled_result([[60.0, 100.0, 140.0], [140.0, 141.0, 139.0]])
    assert compute_band(wandering)[0] == pytest.approx((132.0 - 68.0) / 100.0)
    assert straggler(wandering) == []
    # Tiny models: a sub-millisecond difference is jitter, whatever the ratio.
    assert straggler(profiled_result([[1.0, 1.0, 1.0], [1.9, 1.9, 1.9]])) == []
    assert straggler(profiled_result([[30.0, 31.0]])) == []  # one rank: nobody to compare with


def test_a_straggler_on_a_busy_core_blames_the_machine() -> None:
    loads = [{"rank": r, "core": r, "window_s": 1.0, "own_cpu_s": 0.6, "foreign_cpu_s": share,
              "steal_s": 0.0, "machine_busy_s": 1.5, "threads": 4, "threads_pinned": 4}
             for r, share in enumerate([0.01, 0.45])]
    result = profiled_result([[30.0, 30.0, 30.0], [60.0, 60.0, 60.0]], rank_loads=loads)
    assert result.core_foreign_share_by_rank == [0.01, 0.45]
    [found] = straggler(result)
    assert_line_names(found["message"], "its core", "45%", "timed window")
    assert kinds(annotate([result])[0])[-2:] == ["straggler", "busy_machine"]


