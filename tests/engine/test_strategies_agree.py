"""On the benchmark architectures (ResNet with BatchNorm, GPT with a tied head), every ZeRO stage
trains to the same parameters as replicated data parallelism."""

from __future__ import annotations

import functools

import pytest
import torch

import dspark
from dspark.models import get_workload
from tests.engine.harness import rel_error


def _train(workload: str, strategy: str, global_batch: int) -> dict[str, torch.Tensor]:
    wl = get_workload(workload)
    engine = dspark.Engine(wl.build_model(seed=0), strategy=strategy, bucket_mb=0.5,
                           optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    for step in range(2):
        x, y = dspark.distribute_batch(wl.make_batch(global_batch, seed=step), shard_dim=0)
        engine.backward(wl.loss(engine(x), y))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("workload,global_batch", [("resnet50-cpu", 4), ("gpt2-cpu", 4)])
def test_every_stage_matches_replicate(pool, workload: str, global_batch: int) -> None:
    # BatchNorm running statistics are per rank (as in DDP): compare each rank with itself
    references = pool.run(_train, workload, "replicate", global_batch)
    for strategy in ("zero1", "zero2", "zero3"):
        states = pool.run(_train, workload, strategy, global_batch)
        for rank, (state, reference) in enumerate(zip(states, references, strict=True)):
            assert rel_error(state, reference) <= 1e-5, (workload, strategy, rank)
