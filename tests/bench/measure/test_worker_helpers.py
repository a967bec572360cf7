"""The worker's pure helpers, and the bus bandwidth probe on the 2-rank pool."""

from __future__ import annotations

import statistics

import pytest
import torch

import dspark
from dspark.bench.ledger.measurement import step_time_summary
from dspark.bench.measure.worker import bus_bytes_per_s


def test_step_time_summary_agrees_with_the_standard_library() -> None:
    steps = [10.0, 12.0, 11.0, 30.0, 9.5, 10.5, 11.5]
    median, p10, p90 = step_time_summary(steps)
    deciles = statistics.quantiles(steps, n=10, method="inclusive")
    assert median == statistics.median(steps)
    assert (p10, p90) == pytest.approx((deciles[0], deciles[-1]))
    assert step_time_summary([5.0]) == (5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="no timed step"):
        step_time_summary([])


def _probe() -> float:
    world = dspark.get_world()
    return bus_bytes_per_s(world.device, world.world_size)


def test_bus_bandwidth_is_measured_on_two_ranks(pool) -> None:
    rates = pool.run(_probe)
    assert rates[0] == rates[1] > 1e6  # both report the slowest rank's rate; loopback >> 1 MB/s


def test_bus_bandwidth_is_zero_on_one_rank() -> None:
    assert bus_bytes_per_s(torch.device("cpu"), 1) == 0.0
