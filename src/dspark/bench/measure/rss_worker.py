"""ZeRO's saving in real memory: each rank's peak resident memory (VmHWM) training one model.

``python -m dspark.bench.measure.rss_worker STRATEGY [WIDTH]`` is started by :func:`peak_rss_per_rank`
through the launcher, in fresh processes (a process's peak cannot be reset): each rank builds
:data:`LAYERS` x ``Linear(WIDTH, WIDTH)`` (83.9M parameters at the default width), trains :data:`STEPS` steps with AdamW
under ``STRATEGY`` and prints its peak RSS as one JSON line. ``tests/engine/test_memory_rss.py``
checks the saving and ``benchmarks/zero_real_memory.py`` publishes it.

Example::

    peak_rss_per_rank("zero3")   # [{"rank": 0, "peak_bytes": ..., "num_params": ..., "total_bytes": ...}, ...]
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
from typing import Any

import torch
from torch import nn

import dspark
from dspark.bench.measure.memory import peak_rss_bytes
from dspark.launch.launcher import LaunchSpec, launch

__all__ = ["LAYERS", "STEPS", "WIDTH", "main", "peak_rss_per_rank"]

LAYERS = 5
WIDTH = 4096
STEPS = 2


def peak_rss_per_rank(strategy: str, *, nproc: int = 2, width: int = WIDTH) -> list[dict[str, Any]]:
    """Each rank's ``{"rank", "peak_bytes", "num_params", "total_bytes"}`` (``total_bytes``:
    ``engine.memory_report()``'s), in rank order, from one fresh ``nproc``-rank run under
    ``strategy``; a run that fails is a ``RuntimeError`` with the end of its stderr."""
    done = launch(LaunchSpec(nproc=nproc, target="dspark.bench.measure.rss_worker", module=True,
                             args=(strategy, str(width))), capture=True)
    if done.returncode != 0:
        raise RuntimeError(f"dspark.bench.measure.rss_worker {strategy} on {nproc} ranks exited "
                           f"{done.returncode}:\n{done.stderr[-3000:]}")
    # every rank prints to one pipe, so one rank's line can land inside another's: decode each
    # object where it starts instead of line by line
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(done.stdout)) if done.stdout.startswith('{"rank"', i)]
    rows = [decoder.raw_decode(done.stdout, i)[0] for i in starts]
    if len(rows) != nproc:
        raise RuntimeError(f"dspark.bench.measure.rss_worker {strategy}: {len(rows)} results from {nproc} "
                           f"ranks in its output:\n{done.stdout[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main(strategy: str, width: int = WIDTH) -> None:
    torch.set_num_threads(1)
    world = dspark.init(backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)])
    num_params = sum(p.numel() for p in model.parameters())
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                           strategy=strategy)
    del model
    for step in range(STEPS):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(dspark.distribute_batch(x, shard_dim=0)).square().mean())
        engine.step()
    line = json.dumps({"rank": world.rank, "peak_bytes": peak_rss_bytes(), "num_params": num_params,
                       "total_bytes": engine.memory_report()["total_bytes"]}) + "\n"
    os.write(sys.stdout.fileno(), line.encode())  # one write: the other rank's output cannot split it
    del engine
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], *(int(w) for w in sys.argv[2:3]))
