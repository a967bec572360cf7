"""The plan held to the engine it predicts, on 2 real gloo ranks: model state exactly as
``memory_report()`` measures it, the step's tensor peak within a band of the measured one."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import dspark
from dspark.planner import Plan
from dspark.planner.peak_memory import measure_peak_bytes
from dspark.policy.strategies import STRATEGIES
from tests.planner.test_planner import _batch, _mlp

GLOBAL_BATCH = 64
PEAK_BAND = (0.75, 1.33)
"""Predicted peak / measured peak. Generous: the probe runs plain PyTorch on one device while the
engine adds its own buckets and scratch; a wrong strategy formula or a replicated batch (2x the
activations) falls outside it."""


def _engine_step(strategy: str, **options: object) -> dict[str, int]:
    world = dspark.get_world()
    engine = dspark.Engine(_mlp(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                           strategy=strategy, **options)
    x, y = dspark.distribute_batch(_batch(GLOBAL_BATCH), shard_dim=0)

    def step() -> None:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()

    step()
    peak = measure_peak_bytes(step, world.device)
    report = engine.memory_report()
    engine.close()
    return {"peak": peak, **{k: int(v) for k, v in report.items() if k.endswith("_bytes")}}


@pytest.fixture(scope="module")
def mlp_plan() -> Plan:
    return dspark.plan(_mlp(), _batch(GLOBAL_BATCH), F.cross_entropy, devices=[2])


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_predicted_state_is_memory_report_and_peak_within_band(pool, mlp_plan: Plan, strategy: str) -> None:
    row = mlp_plan.row(strategy, 2)
    rank0 = pool.run(_engine_step, strategy)[0]
    assert (row.params_bytes, row.grads_bytes, row.optimizer_bytes) == (
        rank0["params_bytes"], rank0["grads_bytes"], rank0["optimizer_bytes"]), rank0
    ratio = row.peak_bytes / rank0["peak"]
    assert PEAK_BAND[0] <= ratio <= PEAK_BAND[1], (strategy, row.peak_bytes, rank0["peak"], row)


def _hybrid_engine_step(strategy: str) -> dict[str, int]:
    """Each rank its own shard group: what a rank holds is every row (1/1 of its group's)."""
    return _engine_step(strategy, shard_group_size=1)


@pytest.mark.parametrize("strategy", ["hybrid-zero2", "hybrid-zero3"])
def test_a_hybrid_rows_state_is_memory_report_in_groups_of_one(pool, strategy: str) -> None:
    table = dspark.plan(_mlp(), _batch(GLOBAL_BATCH), F.cross_entropy, devices=[2], strategies=[strategy],
                        shard_group_size=1)
    (row,) = table.rows
    rank0 = pool.run(_hybrid_engine_step, strategy)[0]
    assert (row.params_bytes, row.grads_bytes, row.optimizer_bytes) == (
        rank0["params_bytes"], rank0["grads_bytes"], rank0["optimizer_bytes"]), rank0
    assert PEAK_BAND[0] <= row.peak_bytes / rank0["peak"] <= PEAK_BAND[1], (row.peak_bytes, rank0["peak"])
