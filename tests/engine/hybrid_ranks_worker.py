"""Run by ``test_hybrid_launch.py`` under ``dspark run --nproc N`` (N = 4: 2 shard groups of 2; N = 6:
3 x 2): every hybrid stage trains the loop model with SGD and AdamW, clipped, for comparison with one
process on the whole batch; on 4 ranks a hybrid-zero3 checkpoint is written for the test to load under
zero3 on 2 ranks and replicate on 1, and a zero2 checkpoint of 4 ranks is loaded into hybrid-zero3.

From the repository root, ``PYTHONPATH=. python -m dspark.cli.main run --nproc 4 --oversubscribe
tests/engine/hybrid_ranks_worker.py OUT.pt``: rank 0 saves ``{"states": {(stage, optimizer):
state_dict}, "norms": {...}, "memory": {...}, "bytes": {group: {kind: wire_bytes}}, "checkpoints":
{...}}`` to ``OUT.pt`` (checkpoints beside it)."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

import dspark
from dspark import comm
from tests.engine import loop_models as lm
from tests.engine.four_ranks_worker import final_state, save_and_leave

STEPS = 3
GLOBAL_BATCH = 12
"""Divides by 4 and by 6: every rank gets the same number of rows."""
CLIP = 0.05
"""Below the loop model's gradient norm: every step clips, so the norm must count each shard once."""
GROUP = 2
OPTIMIZERS = {"sgd": functools.partial(torch.optim.SGD, lr=0.5),
              "adamw": functools.partial(torch.optim.AdamW, lr=1e-2)}
STAGES = ("zero1", "zero2", "zero3")


def reference(optimizer: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole batch of every step, clipped: the state and the norms before clipping."""
    model = lm.build()
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    opt = OPTIMIZERS[optimizer](params)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        lm.loss_fn(model(lm.batch(step, GLOBAL_BATCH)[0]), lm.batch(step, GLOBAL_BATCH)[1]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train(strategy: str, optimizer: str, *, steps: range = range(STEPS), engine: dspark.Engine | None = None,
          **options: Any) -> dspark.Engine:
    engine = engine or dspark.Engine(lm.build(), optimizer=OPTIMIZERS[optimizer], strategy=strategy,
                                     clip_grad_norm=CLIP, bucket_mb=1e-4, **options)
    for step in steps:
        x, y = dspark.distribute_batch(lm.batch(step, GLOBAL_BATCH), shard_dim=0)
        engine.backward(lm.loss_fn(engine(x), y))
        engine.step()
    return engine


def checkpoints(out: str) -> dict[str, Any]:
    """hybrid-zero3 (2 x 2) trained and saved; and a zero2 checkpoint of these 4 ranks loaded into
    hybrid-zero3, then saved again by it (the test compares the files)."""
    saved = train("hybrid-zero3", "adamw", shard_group_size=GROUP)
    saved.save(f"{out}.hybrid.ckpt")
    hybrid_state = final_state(saved)
    flat = train("zero2", "adamw")
    flat.save(f"{out}.zero2.ckpt")
    flat_state = final_state(flat)
    loaded = dspark.Engine(lm.build(seed=1), optimizer=OPTIMIZERS["adamw"], strategy="hybrid-zero3",
                           clip_grad_norm=CLIP, bucket_mb=1e-4, shard_group_size=GROUP)
    loaded.load(f"{out}.zero2.ckpt")
    loaded.save(f"{out}.zero2-as-hybrid.ckpt")
    return {"hybrid": hybrid_state, "zero2": flat_state, "zero2_as_hybrid": final_state(loaded)}


def main() -> None:
    world = dspark.init()
    out: dict[str, Any] = {"states": {}, "norms": {}, "memory": {}, "bytes": {}}
    for stage in STAGES:
        for optimizer in OPTIMIZERS:
            comm.reset_stats()
            engine = train(f"hybrid-{stage}", optimizer, shard_group_size=GROUP)
            out["norms"][(stage, optimizer)] = comm.all_gather_object(engine.last_grad_norm)
            out["memory"][(stage, optimizer)] = comm.all_gather_object(engine.memory_report())
            out["bytes"][(stage, optimizer)] = {group: {kind: s.wire_bytes for kind, s in comm.stats(group).items()}
                                                for group in ("world", "shard", "replica")}
            out["states"][(stage, optimizer)] = final_state(engine)
    if world.world_size == 4:
        out["checkpoints"] = checkpoints(sys.argv[1])
    save_and_leave(out, sys.argv[1])


if __name__ == "__main__":
    main()
