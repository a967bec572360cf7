"""Model state found by walking the module and the optimizer: a parameter left gathered shows up."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import dspark
from dspark.bench.analyse.anomalies import memory_above_expected
from dspark.bench.measure.model_state import expected_model_state, held_model_state, param_specs
from tests.bench.factory import make_result
from tests.messages import assert_line_names

MB = 1_000_000


def _as_result(held: dict[str, int], expected: dict[str, int], strategy: str = "zero3") -> Any:
    parts = ("params", "grads", "optimizer")
    return make_result(num_devices=2, strategy=strategy,
                       model_state_bytes_per_rank=sum(held[p] for p in parts),
                       model_state_bytes_expected_per_rank=sum(expected[p] for p in parts),
                       model_state_parts={p: [held[p], expected[p]] for p in parts})


class _ShardedByHand:
    """A test-only zero3 rank 0 of 2: the optimizer updates a copy of rows 0..499 of the weight;
    ``keep_whole`` leaves the module's full weight in place, as an engine that forgot to free it."""

    def __init__(self, *, keep_whole: bool) -> None:
        torch.manual_seed(0)
        self.module = nn.Linear(1000, 1000, bias=False)  # 4 MB
        self.specs = param_specs(self.module)
        shard = nn.Parameter(self.module.weight.detach()[:500].clone())  # 2 MB
        self.optimizer = torch.optim.AdamW([shard], lr=0.1)
        shard.grad = torch.ones_like(shard)
        self.optimizer.step()  # AdamW state: two 2 MB moments and a step scalar
        if not keep_whole:
            self.module.weight.data = torch.empty(0)


def test_a_parameter_left_gathered_is_flagged() -> None:
    for keep_whole in (False, True):
        engine = _ShardedByHand(keep_whole=keep_whole)
        held = held_model_state(engine.module, engine.optimizer)
        expected = expected_model_state(engine.specs, "zero3", engine.optimizer, rank=0,
                                        num_ranks=2)
        flagged = memory_above_expected(_as_result(held, expected), None)
        if keep_whole:
            assert held["params"] == 6 * MB  # the whole weight beside the shard
            (found,) = flagged
            assert_line_names(found["message"], "parameters", "6.0 MB held", "2.0 MB needed")
        else:
            assert held == {**expected, "buffers": 0}  # exactly what the formula says
            assert flagged == []


def test_storages_count_once() -> None:
    tied = nn.Module()
    tied.a = nn.Linear(100, 100, bias=False)
    tied.b = nn.Linear(100, 100, bias=False)
    tied.b.weight = tied.a.weight  # one 40 kB storage under two names
    tied.register_buffer("stat", torch.zeros(10))
    optimizer = torch.optim.SGD([tied.a.weight], lr=0.1)
    tied.a.weight.grad = torch.ones(100, 100)
    assert held_model_state(tied, optimizer) == {"params": 40_000, "grads": 40_000,
                                                  "optimizer": 0, "buffers": 40}


def _zero3_state(left_gathered: bool) -> dict[str, Any]:
    world = dspark.get_world()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))  # ~4.2 MB
    specs = param_specs(model)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                           strategy="zero3")
    for step in range(2):
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(step * 2 + world.rank))
        engine.backward(engine(x).square().mean())
        if step == 1:
            if left_gathered:  # what a zero3 bug that never frees a block's weight leaves behind
                first = next(iter(engine.module.parameters()))
                first.data = torch.zeros(specs[0][0])
            held = held_model_state(engine.module, engine.optimizer)
        engine.step()
    expected = expected_model_state(specs, "zero3", engine.optimizer, rank=world.rank,
                                    num_ranks=world.world_size)
    engine.close()
    return {"held": held, "expected": expected}


def test_a_real_zero3_rank_holds_its_formula_and_a_gathered_weight_shows(pool) -> None:
    for rank in pool.run(_zero3_state, False):
        result = _as_result(rank["held"], rank["expected"])
        assert memory_above_expected(result, None) == []
        assert rank["held"]["params"] == rank["expected"]["params"]
    for rank in pool.run(_zero3_state, True):
        assert rank["held"]["params"] >= rank["expected"]["params"] + 1024 * 1024 * 4
        (found,) = memory_above_expected(_as_result(rank["held"], rank["expected"]), None)
        assert found["memory"] == "model_state"
