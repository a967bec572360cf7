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


def _replicated_inputs(shard_dim: object) -> list[str]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 10, (8,), generator=g)
    mask = torch.ones(8, 5)  # equal on every rank even when split: named, rightly
    return replicated_inputs(dspark.distribute_batch((x, y, mask), shard_dim=shard_dim))


def test_replicated_inputs_names_tensors_identical_on_every_rank(pool) -> None:
    assert pool.run(_replicated_inputs, dspark.REPLICATE) == [["batch[0]", "batch[1]", "batch[2]"]] * 2
    assert pool.run(_replicated_inputs, 0) == [["batch[2]"]] * 2


def test_replicated_inputs_is_empty_on_one_rank(single_process) -> None:
    assert _replicated_inputs(dspark.REPLICATE) == []


def _probe() -> float:
    world = dspark.get_world()
    return bus_bytes_per_s(world.device, world.world_size)


def test_bus_bandwidth_is_measured_on_two_ranks(pool) -> None:
    rates = pool.run(_probe)
    assert rates[0] == rates[1] > 1e6  # both report the slowest rank's rate; loopback >> 1 MB/s


def test_bus_bandwidth_is_zero_on_one_rank() -> None:
    assert bus_bytes_per_s(torch.device("cpu"), 1) == 0.0
