"""The worker's pure helpers, and the bus bandwidth probe on the 2-rank pool."""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.bench.worker import bus_bytes_per_s, replicated_inputs, step_time_summary


def test_step_time_summary_interpolates() -> None:
    assert step_time_summary([10.0, 12.0, 11.0]) == pytest.approx((11.0, 10.2, 11.8))
    assert step_time_summary([5.0]) == (5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="no timed step"):
        step_time_summary([])


def test_replicated_inputs_names_whole_tensors_on_several_ranks() -> None:
    x, y = torch.zeros(8, 3), torch.zeros(8)
    assert replicated_inputs((x, y), (x, y), num_ranks=2) == ["batch[0]", "batch[1]"]
    assert replicated_inputs((x, y), (x[:4], y[:4]), num_ranks=2) == []
    assert replicated_inputs((x, y), (x, y), num_ranks=1) == []


def _probe() -> float:
    world = dspark.get_world()
    return bus_bytes_per_s(world.device, world.world_size)


def test_bus_bandwidth_is_measured_on_two_ranks(pool) -> None:
    rates = pool.run(_probe)
    assert rates[0] == rates[1] > 1e6  # both report the slowest rank's rate; loopback >> 1 MB/s


def test_bus_bandwidth_is_zero_on_one_rank() -> None:
    assert bus_bytes_per_s(torch.device("cpu"), 1) == 0.0
