"""zero2/zero3's gradient reduction on gloo, the ways it can go (see [Note: reduce-scatter on gloo] in
``dspark.comm.collectives``), on N ranks, one core each, threads pinned as in the lab:

1. the collectives alone, for buckets of ``--sizes`` MB of whole gradients: an all-reduce of the
   whole bucket (each rank then keeps its rows), gloo's own reduce-scatter, and DSpark's
   ``comm.reduce_scatter_tensor`` (on gloo an all-to-all and a local sum); median of ``--repeats``;
2. with ``--workload W``: the engine's step under each ``--strategies`` entry with either path for
   its buckets, the two in interleaved rounds (``--rounds``), ``--steps`` steps after two warm-up
   steps each.

Rank 0 prints its own figures; ``--out DIR`` writes the collectives' table as ``DIR/table.json`` and,
with ``--workload``, the steps' as ``DIR/table-steps.json``, for docs/figures.md (see [Note: table
artifacts]).

    dspark run --nproc 2 benchmarks/reduce_scatter.py
    dspark run --nproc 2 benchmarks/reduce_scatter.py --sizes 3 --workload gpt2-cpu --rounds 4
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import dspark
from dspark import comm
from dspark.bench.artifacts.table import write_table
from dspark.bench.measure.barrier_timing import median_call_ms, median_step_ms
from dspark.bench.measure.cpu_load import core_for_rank, pin_all_threads
from dspark.bench.measure.rounds import interleaved_rounds
from dspark.engine.for_the_lab import SHARDED_REDUCE, SHM_ENV
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


def collectives(sizes: list[float], repeats: int, world: dspark.World) -> tuple[list[str], list[list[str]]]:
    """Prints rank 0's timings per bucket size; returns them as a table's columns and rows."""
    columns: list[str] = []
    rows = []
    for mb in sizes:
        timings = _bucket_timings(mb, world.world_size, repeats)
        columns = ["bucket MB", *(f"{name} ms" for name in timings)]
        rows.append([f"{mb:g}", *(f"{ms:.2f}" for ms in timings.values())])
        if world.is_main:
            print(f"{mb:g} MB bucket: " + ", ".join(f"{name} {ms:.2f} ms"
                                                     for name, ms in timings.items()), flush=True)
    return columns, rows


def _step_ms(workload_name: str, strategy: str, precision: str, path: str, steps: int, global_batch: int,
             world: dspark.World) -> float:
    # the engine's per-backend choice (as tests/engine/test_training_loops.py sets it)
    SHARDED_REDUCE[world.backend] = path
    workload = get_workload(workload_name)
    engine = dspark.Engine(workload.build_model(seed=0), strategy=strategy, precision=precision,
                           optimizer=functools.partial(torch.optim.AdamW, lr=3e-4))
    # two warm-up steps: the first also rebuilds the buckets
    return median_step_ms(engine, workload, global_batch, steps, warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5,3,12,25", help="bucket sizes in MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--workload", help="also time the engine's step on this workload")
    parser.add_argument("--strategies", default="zero2,zero3")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the workload's")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # threads started later (gloo's) inherit the main thread's core
    core = core_for_rank(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if core is not None:  # None: fewer cores than ranks, nobody is pinned
        pin_all_threads(core)
    # this compares gloo's own paths: DSpark's shared-memory transport would carry them otherwise
    os.environ[SHM_ENV] = "0"
    world = dspark.init()
    if world.backend != "gloo":
        raise SystemExit(f"this compares gloo's paths; the backend here is {world.backend}")
    if world.is_main:
        print(f"{world.world_size} gloo ranks, one core each", flush=True)
    columns, rows = collectives([float(s) for s in args.sizes.split(",")], args.repeats, world)
    cores = "one core each, threads pinned" if core is not None else "threads not pinned (fewer cores than ranks)"
    if world.is_main and args.out is not None:
        write_table(args.out, columns=columns, rows=rows,
                    caption=f"{world.world_size} gloo ranks (DSpark's shared-memory transport off), {cores}. "
                            f"A bucket of MB (2^20 bytes) of fp32 gradients on every rank, each rank "
                            f"keeping 1/{world.world_size} of it; DSpark's reduce-scatter on gloo is an "
                            f"all-to-all and a local sum. Rank 0's median wall time of {args.repeats} "
                            f"calls after 3 warm-up calls, every call started on all ranks together.")
    def measure(strategy: str, path: str) -> tuple[str, float]:
        return "", _step_ms(args.workload, strategy, args.precision, path, args.steps, global_batch, world)

    global_batch = args.global_batch or (get_workload(args.workload).default_global_batch if args.workload else 0)
    if args.workload:
        step_rows = []
        for strategy in args.strategies.split(","):
            if world.is_main:
                print(f"{args.workload}, {strategy}, {args.precision}", flush=True)
            paths = {path: f"{strategy} by {path}" for path in ("all_reduce", "reduce_scatter")}
            values = interleaved_rounds({name: functools.partial(measure, strategy, path)
                                          for path, name in paths.items()},
                                         args.rounds, verbose=world.is_main)
            step_rows += [[strategy, path, f"{statistics.median(values[name]):.1f}",
                           f"{min(values[name]):.1f}-{max(values[name]):.1f}"] for path, name in paths.items()]
        if world.is_main and args.out is not None:
            write_table(args.out, name="table-steps.json",
                        columns=["strategy", "buckets reduced by", "step ms", "rounds min-max ms"],
                        rows=step_rows,
                        caption=f"The engine's step on {args.workload} (global batch "
                                f"{global_batch}, {args.precision}, "
                                f"AdamW), {world.world_size} gloo ranks, {cores}. Each engine: 2 warm-up "
                                f"steps, then the median of {args.steps} steps; the two paths interleaved "
                                f"over {args.rounds} rounds, the order rotating; the median over the rounds "
                                f"of rank 0's figure.")
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
