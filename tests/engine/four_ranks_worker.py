"""Run by ``test_four_ranks.py`` under ``dspark run --nproc 4``: the collectives and every strategy on
four ranks, where the 2-rank pool cannot look (uneven shards over 4: a 13-row embedding is split
4 + 4 + 4 + 1; the all-to-all behind gloo's reduce-scatter routes N x N pieces, not 2 x 2).

From the repository root, ``PYTHONPATH=. python -m dspark.cli.main run --nproc 4
tests/engine/four_ranks_worker.py OUT.pt``: rank 0 saves
``{"collectives": {...}, "states": {(strategy, optimizer): state_dict}}`` to ``OUT.pt``."""

from __future__ import annotations

import functools
import gc
import sys

import torch

import dspark
from dspark import comm
from tests.engine import loop_models as lm

STEPS = 3
OPTIMIZERS = {"sgd": functools.partial(torch.optim.SGD, lr=0.5),
              "adamw": functools.partial(torch.optim.AdamW, lr=1e-2)}


def collectives(rank: int, n: int) -> dict[str, list[float]]:
    # rank r sends r + 1 times [0, 1, ..., 3n - 1]; chunk k of the sum is (sum of r + 1) * chunk k
    rs = torch.empty(3)
    comm.reduce_scatter_tensor(rs, torch.arange(3.0 * n) * (rank + 1))
    rs_avg = torch.empty(3)
    comm.reduce_scatter_tensor(rs_avg, torch.arange(3.0 * n) * (rank + 1), op="avg", async_op=True).wait()
    gathered = torch.empty(2 * n)
    comm.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    total = torch.full((4,), float(rank))
    comm.all_reduce(total)
    return {"rs": rs.tolist(), "rs_avg": rs_avg.tolist(), "gathered": gathered.tolist(),
            "all_reduce": total.tolist()}


def train(strategy: str, optimizer: str) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(lm.build(), optimizer=OPTIMIZERS[optimizer], strategy=strategy,
                           bucket_mb=1e-4)  # a bucket per parameter: many all-to-alls in flight
    for step in range(STEPS):
        x, y = dspark.distribute_batch(lm.batch(step), shard_dim=0)
        engine.backward(lm.loss_fn(engine(x), y))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    del engine
    gc.collect()
    return state


def main() -> None:
    world = dspark.init()
    out = {"collectives": collectives(world.rank, world.world_size), "states": {}}
    for strategy in ("replicate", "zero1", "zero2", "zero3"):
        for optimizer in OPTIMIZERS:
            out["states"][(strategy, optimizer)] = train(strategy, optimizer)
    if world.rank == 0:
        torch.save(out, sys.argv[1])
    comm.barrier()
    dspark.shutdown()


if __name__ == "__main__":
    main()
