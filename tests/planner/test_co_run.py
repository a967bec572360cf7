"""[Note: co-run slowdown]: the factor from a made-up measurement, and what a row pays for it (no process)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from torch import nn

from dspark.planner import Interconnect, Probe, model_shape
from dspark.planner.co_run import CoRun, co_run_parts
from dspark.planner.cost import row_cost
from tests.messages import assert_names

MIB = 1 << 20
# in a core's cache no slower; from 64 MiB to 1 GiB 1.5x slower beside the other rank; the matrix multiply 1.1x
CO_RUN = CoRun(ranks=2, pass_points=((MIB, 1e-4, 1e-4), (32 * MIB, 4e-3, 4e-3), (64 * MIB, 8e-3, 12e-3),
                                     (1024 * MIB, 128e-3, 192e-3)),
               compute_alone_s=1e-3, compute_together_s=1.1e-3)
LINK = Interconnect(name="serial", bytes_per_s=1e9, latency_s=0.0, overlaps_compute=False, source="by hand",
                    co_run=CO_RUN)


def test_a_pass_is_slowed_by_its_working_set_as_measured() -> None:
    assert CO_RUN.pass_factor(4 * MIB) == 1.0  # the cache holds it
    assert CO_RUN.pass_factor(45 * MIB) == pytest.approx(1.25, rel=1e-2)  # halfway in log2 from 32 to 64 MiB
    assert CO_RUN.pass_factor(1 << 30) == pytest.approx(1.5)
    assert CO_RUN.pass_factor(2 << 30) == 1.0  # past the largest size measured: nothing is known
    assert CO_RUN.pass_bytes_per_s(64 * MIB) == pytest.approx(64 * MIB / 8e-3)
    assert CO_RUN.compute_factor == pytest.approx(1.1)
    # a shared cache that holds one rank's 64 MiB but not both ranks': slowed there, not past it
    bump = CoRun(ranks=2, pass_points=((MIB, 1e-4, 1e-4), (64 * MIB, 3e-3, 5e-3), (256 * MIB, 20e-3, 20e-3)),
                 compute_alone_s=1e-3, compute_together_s=0.5e-3)
    assert bump.pass_factor(64 * MIB) == pytest.approx(5 / 3) and bump.pass_factor(256 * MIB) == 1.0
    assert bump.compute_factor == 1.0  # faster together is never priced


def test_a_measurement_that_cannot_be_a_slowdown_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        CoRun(ranks=2, pass_points=((64 * MIB, 1e-3, 1e-3), (MIB, 1e-4, 1e-4)), compute_alone_s=1e-3,
              compute_together_s=1e-3)
    assert_names(str(err.value), "pass_points=", str(64 * MIB), "ranks=2")
    with pytest.raises(ValueError) as err:
        CoRun.from_dict({"ranks": 2})
    assert_names(str(err.value), "'ranks'", "measure_co_run")


def test_the_link_carries_the_measurement_through_its_json() -> None:
    again = Interconnect.from_dict(json.loads(json.dumps(dataclasses.asdict(LINK))))
    assert again == LINK
    older = {k: v for k, v in dataclasses.asdict(LINK).items() if k != "co_run"}  # an artifact kept before it
    assert Interconnect.from_dict(older).co_run is None


def test_compute_pays_the_pass_slowdown_on_its_memory_time_and_the_multiply_s_on_the_rest() -> None:
    alone = co_run_parts(None, compute_ms=100.0, optimizer_ms=10.0, check_ms=1.0, compute_working_set_bytes=1e9,
                         compute_traffic_bytes=1e9, optimizer_working_set_bytes=1e9, check_working_set_bytes=1e9)
    assert (alone.compute_ms, alone.optimizer_ms, alone.check_ms) == (100.0, 10.0, 1.0)
    shared = co_run_parts(CO_RUN, compute_ms=100.0, optimizer_ms=10.0, check_ms=1.0,
                          compute_working_set_bytes=1e9, compute_traffic_bytes=0.2e9,
                          optimizer_working_set_bytes=2 * MIB, check_working_set_bytes=1e9)
    memory_ms = 1e3 * 0.2e9 / (64 * MIB / 8e-3)
    assert shared.compute_ms == pytest.approx(1.5 * memory_ms + 1.1 * (100.0 - memory_ms))
    assert shared.optimizer_ms == 10.0 and shared.check_ms == pytest.approx(1.5)  # in cache / past it
    assert shared.optimizer_factor == pytest.approx(11.5 / 11.0)


def _probe(device: str = "cpu") -> Probe:
    return Probe.from_one_step(device=device, batch=8, forward_ms=100.0, backward_ms=200.0, optimizer_ms=40.0,
                               step_bytes=1e6, num_params=4, unit_bytes=[0, 1, 1])


def _row(model: nn.Module, ranks: int, link: Interconnect = LINK, device: str = "cpu"):
    return row_cost(shape=model_shape(model, (2, True)), probe=_probe(device), strategy="replicate",
                    num_ranks=ranks, micro_batch=8 // ranks, passes=1, bucket_mb=25.0, link=link)


def test_a_row_with_several_ranks_on_a_cpu_node_pays_the_slowdown_of_its_working_sets() -> None:
    wide = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096))  # 134 MB of weights: past the cache
    small = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))     # 0.5 MB: in it
    plain = dataclasses.replace(LINK, co_run=None)
    row, alone = _row(wide, 2), _row(wide, 2, plain)
    assert row.co_run_optimizer_factor == pytest.approx(1.5)  # the step's rows, gradients and moments
    assert row.optimizer_ms == pytest.approx(1.5 * alone.optimizer_ms)
    params = 2 * 4 * (4096 * 4096 + 4096)
    memory_ms = 1e3 * (3 * params + 2 * _probe().activation_bytes(4)) / (64 * MIB / 8e-3)
    assert row.compute_ms == pytest.approx(1.5 * memory_ms + 1.1 * (alone.compute_ms - memory_ms), rel=1e-6)
    assert row.co_run_compute_factor == pytest.approx(row.compute_ms / alone.compute_ms)
    in_cache = _row(small, 2)
    assert in_cache.co_run_optimizer_factor == 1.0 and in_cache.co_run_compute_factor == pytest.approx(1.1, rel=1e-2)
    # nobody beside it: one rank, one rank per node, or a GPU's ranks (a device each)
    for lone in (_row(wide, 1), _row(wide, 2, dataclasses.replace(LINK, ranks_per_node=1)),
                 _row(wide, 2, device="cuda:0")):
        assert (lone.co_run_compute_factor, lone.co_run_optimizer_factor) == (1.0, 1.0)
