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

import torch

import dspark
from dspark.bench.measure.barrier_timing import median_step_ms
from dspark.bench.measure.cpu_load import core_for_rank, pin_all_threads
from dspark.bench.measure.rounds import interleaved_rounds
from dspark.models import get_workload


def _step_ms(workload_name: str, strategy: str, precision: str, bucket_mb: float,
             steps: int, global_batch: int | None) -> float:
    workload = get_workload(workload_name)
    engine = dspark.Engine(workload.build_model(seed=0), strategy=strategy, precision=precision,
                           optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                           bucket_mb=bucket_mb)
    # two warm-up steps: the first also rebuilds the buckets
    return median_step_ms(engine, workload, global_batch or workload.default_global_batch, steps, warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-cpu")
    parser.add_argument("--strategy", default="replicate")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--sizes", default="25,4,1", help="comma-separated bucket_mb values")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the workload's")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        core = core_for_rank(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if core is not None:  # more ranks than cores: leave the threads unpinned
            pin_all_threads(core)
    world = dspark.init()
    def measure(size: float) -> tuple[str, float]:
        return "", _step_ms(args.workload, args.strategy, args.precision, size, args.steps, args.global_batch)

    if world.is_main:
        print(f"{args.workload}, {args.strategy}, {args.precision}, {world.world_size} ranks", flush=True)
    interleaved_rounds({f"bucket_mb={float(s):g}": functools.partial(measure, float(s))
                         for s in args.sizes.split(",")}, args.rounds, verbose=world.is_main)
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
