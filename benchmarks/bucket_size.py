"""The engine's step with several gradient bucket sizes (``Engine(bucket_mb=...)``), on N ranks,
interleaved: each round builds the model and an engine per size, in rotating order, times
``--steps`` steps after two warm-up steps, and rank 0 prints each size's median step per round and
the median over rounds. Threads are pinned one core per rank, as in the lab.

    dspark run --nproc 2 benchmarks/bucket_size.py --workload gpt2-cpu --sizes 25,4,1 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import time

import torch

import dspark
from dspark import comm
from dspark.bench.cpu_load import core_for_rank, pin_all_threads
from dspark.models import get_workload


def _step_ms(workload_name: str, strategy: str, precision: str, bucket_mb: float, steps: int,
             world: dspark.World) -> float:
    workload = get_workload(workload_name)
    model = workload.build_model(seed=0)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                           strategy=strategy, precision=precision, bucket_mb=bucket_mb)
    global_batch = workload.default_global_batch
    inputs, targets = workload.make_batch(global_batch, seed=0)
    share = global_batch // world.world_size
    rows = slice(world.rank * share, (world.rank + 1) * share)
    x, y = inputs[rows], targets[rows]
    times = []
    for step in range(steps + 2):  # two warm-up steps: the first also rebuilds the buckets
        comm.barrier()
        start = time.perf_counter()
        engine.backward(workload.loss(engine(x), y))
        engine.step()
        if step >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    engine.close()
    del engine, model
    gc.collect()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-cpu")
    parser.add_argument("--strategy", default="replicate")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--sizes", default="25,4,1", help="comma-separated bucket_mb values")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        pin_all_threads(core_for_rank(int(os.environ.get("LOCAL_RANK", "0")),
                                      int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    world = dspark.init()
    sizes = [float(s) for s in args.sizes.split(",")]
    medians: dict[float, list[float]] = {s: [] for s in sizes}
    for round_index in range(args.rounds):
        order = sizes[round_index % len(sizes):] + sizes[:round_index % len(sizes)]
        for size in order:
            ms = _step_ms(args.workload, args.strategy, args.precision, size, args.steps, world)
            medians[size].append(ms)
            if world.is_main:
                print(f"round {round_index}: bucket_mb={size:g}: {ms:.1f} ms", flush=True)
    if world.is_main:
        for size, values in medians.items():
            print(f"{args.workload} {args.strategy} bucket_mb={size:g}: median step "
                  f"{statistics.median(values):.1f} ms (rounds {min(values):.1f}-{max(values):.1f})")
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
