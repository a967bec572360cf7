"""The per-step buffer sync alone: every buffer of a workload's model broadcast from rank 0, as the
engine does before each training forward (``dspark.engine.buffer_sync.broadcast_tensors``; a
ResNet's BatchNorm statistics change every step, so all of them travel). Median ms per call over
``--repeats`` calls after ``--warmup``, on each rank.

    dspark run --nproc 2 benchmarks/buffer_sync.py --workload resnet50-cpu
    DSPARK_SHM=0 dspark run --nproc 2 benchmarks/buffer_sync.py   # through gloo instead
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import dspark
from dspark import comm
from dspark.engine.buffer_sync import broadcast_tensors
from dspark.models import get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="resnet50-cpu")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = dspark.init()
    model = get_workload(args.workload).build_model(seed=0, device=world.device)
    buffers = list(model.buffers())
    for _ in range(args.warmup):
        broadcast_tensors(buffers)
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        broadcast_tensors(buffers)
        times.append((time.perf_counter() - started) * 1e3)
    line = (f"rank {world.rank}: {args.workload}, {len(buffers)} buffers "
            f"({sum(b.numel() for b in buffers)} elements), transport {comm.transport()}: "
            f"broadcast_tensors {statistics.median(times):.2f} ms (median of {args.repeats})")
    print(line, flush=True)
    del model, buffers
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
