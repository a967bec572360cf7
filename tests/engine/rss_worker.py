"""Run by `dspark.launch.launcher` in fresh processes: build a ~84M-parameter model, train 2 steps with the
given strategy, and report this rank's peak resident memory (VmHWM) as JSON on stdout."""

from __future__ import annotations

import functools
import gc
import json
import os
import resource
import sys

import torch
from torch import nn

import dspark


def main(strategy: str) -> None:
    torch.set_num_threads(1)
    world = dspark.init(backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(5)])
    num_params = sum(p.numel() for p in model.parameters())
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                           strategy=strategy)
    del model
    for step in range(2):
        x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(step))
        (local,) = (dspark.distribute_batch(x, shard_dim=0),)
        engine.backward(engine(local).square().mean())
        engine.step()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = json.dumps({"rank": world.rank, "peak_bytes": peak_kib * 1024, "num_params": num_params,
                       "total_bytes": engine.memory_report()["total_bytes"]}) + "\n"
    os.write(sys.stdout.fileno(), line.encode())  # one write: the other rank's output cannot split it
    del engine
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
