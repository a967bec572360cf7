"""zero2/zero3's gradient reduction on gloo, the ways it can go (see [Note: reduce-scatter on gloo] in
``dspark.comm.collectives``), on N ranks, one core each, threads pinned as in the lab:

1. the collectives alone, for buckets of ``--sizes`` MB of whole gradients: an all-reduce of the
   whole bucket (each rank then keeps its rows), gloo's own reduce-scatter, and DSpark's
   ``comm.reduce_scatter_tensor`` (on gloo an all-to-all and a local sum); median of ``--repeats``;
2. with ``--workload W``: the engine's step under each ``--strategies`` entry with either path for
   its buckets, the two in interleaved rounds (``--rounds``), ``--steps`` steps after two warm-up
   steps each.

    dspark run --nproc 2 benchmarks/reduce_scatter.py
    dspark run --nproc 2 benchmarks/reduce_scatter.py --sizes 3 --workload gpt2-cpu --rounds 4
"""

from __future__ import annotations

import argparse
import functools
import gc
import os

import torch
import torch.distributed as dist
from interleaved import interleaved_medians, median_call_ms, median_step_ms

import dspark
from dspark import comm
from dspark.bench.cpu_load import core_for_rank, pin_all_threads
from dspark.comm import shm_transport
from dspark.engine import build as build_module
from dspark.models import get_workload


def _bucket_timings(mb: float, n: int, repeats: int) -> dict[str, float]:
    seg = int(mb * 2**20 / 4 / n)  # a bucket of mb MB of fp32 gradients, seg elements per rank
    bucket = torch.randn(n * seg)
    rows = torch.empty(seg)
    return {
        "all-reduce of the bucket": median_call_ms(lambda: comm.all_reduce(bucket), repeats),
        # gloo's own, called directly: DSpark's comm layer no longer takes this path on gloo
        "gloo's reduce-scatter": median_call_ms(lambda: dist.reduce_scatter_tensor(rows, bucket),
                                            repeats),
        "DSpark's reduce-scatter": median_call_ms(lambda: comm.reduce_scatter_tensor(rows, bucket),
                                              repeats),
    }


def collectives(sizes: list[float], repeats: int, world: dspark.World) -> None:
    for mb in sizes:
        timings = _bucket_timings(mb, world.world_size, repeats)
        if world.is_main:
            print(f"{mb:g} MB bucket: " + ", ".join(f"{name} {ms:.2f} ms"
                                                     for name, ms in timings.items()), flush=True)


def _step_ms(workload_name: str, strategy: str, precision: str, path: str, steps: int,
             world: dspark.World) -> float:
    # the engine's per-backend choice (as tests/engine/test_training_loops.py sets it)
    build_module.SHARDED_REDUCE[world.backend] = path
    workload = get_workload(workload_name)
    engine = dspark.Engine(workload.build_model(seed=0), strategy=strategy, precision=precision,
                           optimizer=functools.partial(torch.optim.AdamW, lr=3e-4))
    # two warm-up steps: the first also rebuilds the buckets
    return median_step_ms(engine, workload, workload.default_global_batch, steps, warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5,3,12,25", help="bucket sizes in MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--workload", help="also time the engine's step on this workload")
    parser.add_argument("--strategies", default="zero2,zero3")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pin_all_threads(core_for_rank(int(os.environ.get("LOCAL_RANK", "0")),
                                  int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    # this compares gloo's own paths: DSpark's shared-memory transport would carry them otherwise
    os.environ[shm_transport.SHM_ENV] = "0"
    world = dspark.init()
    if world.backend != "gloo":
        raise SystemExit(f"this compares gloo's paths; the backend here is {world.backend}")
    if world.is_main:
        print(f"{world.world_size} gloo ranks, one core each", flush=True)
    collectives([float(s) for s in args.sizes.split(",")], args.repeats, world)
    def measure(strategy: str, path: str) -> tuple[str, float]:
        return "", _step_ms(args.workload, strategy, args.precision, path, args.steps, world)

    if args.workload:
        for strategy in args.strategies.split(","):
            if world.is_main:
                print(f"{args.workload}, {strategy}, {args.precision}", flush=True)
            interleaved_medians({f"{strategy} by {path}": functools.partial(measure, strategy, path)
                                 for path in ("all_reduce", "reduce_scatter")},
                                args.rounds, verbose=world.is_main)
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
