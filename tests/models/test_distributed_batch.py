"""On real ranks: every rank makes the same global batch and model, and distribute_batch splits it."""

from __future__ import annotations

import torch

import dspark
from dspark.models import get_workload


def _rank_batch_and_weights(name: str, global_batch: int) -> dict[str, object]:
    wl = get_workload(name)
    inputs, targets = dspark.distribute_batch(wl.make_batch(global_batch, seed=11), shard_dim=0)
    weights = torch.cat([p.detach().flatten() for p in wl.build_model(seed=3).parameters()])
    return {"inputs": inputs, "targets": targets, "weights": weights}


def test_each_rank_gets_its_slice_of_the_same_global_batch(pool) -> None:
    for name in ("resnet50-cpu", "gpt2-cpu"):
        r0, r1 = pool.run(_rank_batch_and_weights, name, 4)
        inputs, targets = get_workload(name).make_batch(4, seed=11)
        torch.testing.assert_close(torch.cat([r0["inputs"], r1["inputs"]]), inputs, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([r0["targets"], r1["targets"]]), targets, rtol=0, atol=0)
        assert r0["inputs"].shape[0] == 2  # type: ignore[attr-defined]
        torch.testing.assert_close(r0["weights"], r1["weights"], rtol=0, atol=0)
