"""Run by ``test_four_ranks.py`` under ``dspark run --nproc 4``: the collectives and every strategy on
four ranks, where the 2-rank pool cannot look (uneven shards over 4: a 13-row embedding is split
4 + 4 + 4 + 1; the all-to-all behind gloo's reduce-scatter routes N x N pieces, not 2 x 2), and a
model so small that rank 3 owns no row of any parameter, through a checkpoint; and HuggingFace
models evaluated on 3 samples, where rank 3 has no sample (tests/data/eval_lengths.py).

From the repository root, ``PYTHONPATH=. python -m dspark.cli.main run --nproc 4
--oversubscribe tests/engine/four_ranks_worker.py OUT.pt`` (--oversubscribe: on fewer than 4 cores): rank 0 saves
``{"collectives": {...}, "states": {(strategy, optimizer): state_dict}, "rowless": {(strategy,
optimizer): state_dict}, "eval": {(model, strategy): result}}`` to ``OUT.pt``."""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable

import torch

import dspark
from dspark import comm
from tests.data import eval_lengths
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
    return final_state(engine)


def final_state(engine: dspark.Engine) -> dict[str, torch.Tensor]:
    """The engine's full state dict; the engine is closed and freed (gloo exits cleanly)."""
    state = engine.full_state_dict()
    engine.close()
    del engine
    gc.collect()
    return state


def rowless_model() -> torch.nn.Module:
    """Every parameter has at most 3 rows: over 4 ranks, rank 3 owns no row of any of them."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def rowless_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)


def rowless_loss(model: Callable[[torch.Tensor], torch.Tensor], step: int, *, split: bool) -> torch.Tensor:
    """The step's loss on the whole batch, or (``split``) on this rank's rows of it."""
    x, y = rowless_batch(step)
    if split:
        x, y = dspark.distribute_batch((x, y), shard_dim=0)
    return torch.nn.functional.mse_loss(model(x), y)


def train_rowless(strategy: str, optimizer: str, checkpoint: str) -> dict[str, torch.Tensor]:
    """STEPS steps, a checkpoint, a fresh engine loads it, STEPS more steps."""
    engine = dspark.Engine(rowless_model(), optimizer=OPTIMIZERS[optimizer], strategy=strategy)
    for step in range(2 * STEPS):
        if step == STEPS:
            engine.save(checkpoint)
            engine.close()
            engine = dspark.Engine(rowless_model(), optimizer=OPTIMIZERS[optimizer], strategy=strategy)
            engine.load(checkpoint)
        engine.backward(rowless_loss(engine, step, split=True))
        engine.step()
    return final_state(engine)


def main() -> None:
    world = dspark.init()
    out = {"collectives": collectives(world.rank, world.world_size), "states": {}}
    for strategy in ("replicate", "zero1", "zero2", "zero3"):
        for optimizer in OPTIMIZERS:
            out["states"][(strategy, optimizer)] = train(strategy, optimizer)
    out["rowless"] = {(strategy, optimizer): train_rowless(strategy, optimizer,
                                                           f"{sys.argv[1]}.{strategy}.{optimizer}.ckpt")
                      for strategy in ("zero1", "zero2", "zero3") for optimizer in OPTIMIZERS}
    out["eval"] = {}
    for model in eval_lengths.MODELS:
        for strategy in ("replicate", "zero1", "zero2", "zero3"):
            result = eval_lengths.evaluate(model, strategy, 3, 4)
            result["rows"] = comm.all_gather_object(result["rows"])  # every rank's
            out["eval"][(model, strategy)] = result
    save_and_leave(out, sys.argv[1])


def save_and_leave(out: dict, path: str) -> None:
    """Rank 0 saves ``out`` to ``path``; every rank leaves once it is written."""
    if dspark.get_world().rank == 0:
        torch.save(out, path)
    comm.barrier()
    dspark.shutdown()


if __name__ == "__main__":
    main()
