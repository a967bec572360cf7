"""The batch probe: what each rank's model received, measured on real ranks (the pool), and the
comparison logic on its own."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch
from torch import nn

import dspark
from dspark import comm
from dspark.bench.measure.batch_probe import BatchProbe, compare_ranks, inspect_batches


class _Model(nn.Module):
    """A block fed the batch, plus a position table fed the same ids on every rank and every step
    (an input that is equal across ranks by design, not a replicated batch). ``gather=True`` makes
    the model's own code gather every rank's rows before the block: a replication inside it."""

    def __init__(self, *, gather: bool = False) -> None:
        super().__init__()
        self.gather = gather
        self.pos = nn.Embedding(4, 6)
        self.body = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos(torch.arange(x.shape[0]) % 4)
        if self.gather:
            x = torch.cat(comm.all_gather(x))  # (N * B, 6): every rank computes on every row
        return self.body(x)


def _probe(case: str) -> dict[str, Any]:
    world = dspark.get_world()
    torch.manual_seed(0)
    model = _Model(gather=case == "inside")

    def step(seed: int) -> None:
        whole = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))  # (B, 6)
        take_all = case == "replicate" or (case == "one_rank" and world.rank == 1)
        x = whole if take_all else whole[world.rank * 4:(world.rank + 1) * 4]
        model(x).square().mean().backward()

    inspection = inspect_batches(model, [lambda: step(1), lambda: step(2)], comm.all_gather_object)
    return asdict(inspection)


def test_split_batches_are_not_flagged(pool) -> None:
    first, second = pool.run(_probe, "shard")
    assert first == second  # every rank gets the same verdict
    assert first == {"samples_by_rank": [4, 4], "identical_input_ranks": [],
                     "replicated_modules": [], "replicated_module_count": 0}


def test_the_same_batch_on_every_rank_is_seen_at_the_root(pool) -> None:
    found, _ = pool.run(_probe, "replicate")
    assert found["samples_by_rank"] == [8, 8] and found["identical_input_ranks"] == [[0, 1]]
    assert found["replicated_modules"] == []  # implied by the root; not listed again


def test_one_rank_taking_the_whole_batch_is_seen(pool) -> None:
    found, _ = pool.run(_probe, "one_rank")
    assert found["samples_by_rank"] == [4, 8] and found["identical_input_ranks"] == []


def test_a_replication_inside_the_models_code_is_seen(pool) -> None:
    # The root received split batches; the block received every rank's rows on both ranks.
    found, _ = pool.run(_probe, "inside")
    assert found["samples_by_rank"] == [4, 4] and found["identical_input_ranks"] == []
    assert found["replicated_modules"] == ["body"]
    assert found["replicated_module_count"] == 4  # body, its two Linears and the Tanh


def test_probe_records_calls_and_removes_its_hooks() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    probe = BatchProbe(model)
    model(torch.ones(3, 2))
    samples, prints = probe.take()
    assert samples == 3 and set(prints) == {("", 0), ("0", 0), ("1", 0)}
    probe.close()
    model(torch.ones(3, 2))
    assert probe.take() == (0, {})


def test_compare_ranks_needs_a_batch_derived_input() -> None:
    root, fixed, data = ("", 0), ("pos", 0), ("body", 0)

    def fp(value: float) -> tuple[float, ...]:  # leaves, elements, four statistics
        return (1.0, 24.0, value, value, value, value)

    step_a = [{root: fp(1.0), fixed: fp(5.0), data: fp(7.0)},
              {root: fp(2.0), fixed: fp(5.0), data: fp(7.0)}]
    step_b = [{root: fp(3.0), fixed: fp(5.0), data: fp(9.0)},
              {root: fp(4.0), fixed: fp(5.0), data: fp(9.0)}]
    found = compare_ranks(step_a, step_b, [4, 4])
    assert found.replicated_modules == ["body"]  # "pos" was equal, but equal in both steps too
    with pytest.raises(ValueError, match="exactly two"):
        inspect_batches(nn.Linear(1, 1), [lambda: None], comm.all_gather_object)
