"""DSpark's collectives through shared memory against gloo, for ranks of one machine, one core each,
threads pinned as in the lab (see [Note: the shared-memory transport] in ``dspark.comm``).

For each message size in ``--sizes`` (MB of fp32): all-reduce, all-gather (each rank's shard is
1/N of the message) and reduce-scatter (each rank keeps 1/N), through DSpark's default group (shared
memory when ``dspark.comm.transport()`` says ``shm``) and through a side group, which is always
gloo. The two alternate call by call; each figure is the median of ``--repeats`` calls, in wall
time and in the process's CPU time (gloo's threads included). Rank 0 prints its own figures;
``--out DIR`` writes that table as ``DIR/table.json`` for docs/figures.md (see [Note: table
artifacts]).

    dspark run --nproc 2 benchmarks/shm_collectives.py
    dspark run --nproc 2 benchmarks/shm_collectives.py --sizes 1,25 --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import dspark
from dspark import comm
from dspark.bench.artifacts.table import write_table
from dspark.bench.measure.cpu_load import core_for_rank, pin_all_threads


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    comm.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def _pin(core: int | None) -> None:
    if core is not None:  # None: fewer cores than ranks, nobody is pinned
        pin_all_threads(core)


def _calls(numel: int, n: int) -> dict[str, Callable[[comm.Group | None], object]]:
    whole, part = torch.randn(numel), torch.randn(numel // n)
    out_whole, out_part = torch.empty(numel), torch.empty(numel // n)
    return {
        "all_reduce": lambda g: comm.all_reduce(whole, group=g),
        "all_gather": lambda g: comm.all_gather_into_tensor(out_whole, part, group=g),
        "reduce_scatter": lambda g: comm.reduce_scatter_tensor(out_part, whole, group=g),
    }


def _compare(call: Callable[[comm.Group | None], object], gloo: comm.Group, repeats: int
             ) -> tuple[list[float], list[float]]:
    """(wall ms, CPU ms) medians through the default group and through gloo, call by call."""
    ours, theirs = [], []
    for _ in range(3):   # warm-up: gloo's pairs and buffers, the mapping's pages
        call(None)
        call(gloo)
    for _ in range(repeats):
        ours.append(_timed(lambda: call(None)))
        theirs.append(_timed(lambda: call(gloo)))
    return ([statistics.median(x) for x in zip(*ours, strict=True)],
            [statistics.median(x) for x in zip(*theirs, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,5,21", help="message sizes in MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = dspark.init()
    # the core is chosen once: once pinned, this process sees one core only (core_for_rank: None)
    core = core_for_rank(world.local_rank, world.local_world_size)
    _pin(core)
    gloo = comm.new_group()
    _pin(core)   # gloo's new threads too
    n = world.world_size
    if world.rank == 0:
        print(f"{n} ranks, default group through {comm.transport()!r}, side group through 'gloo'; "
              f"median of {args.repeats} calls, ms wall / ms CPU of the process")
        print(f"{'MB':>5} {'collective':<15} {'DSpark default':>16} {'gloo':>16} {'wall ratio':>10}")
    rows = []
    for mb in (float(s) for s in args.sizes.split(",")):
        for name, call in _calls(int(mb * 1e6 / 4) // n * n, n).items():
            ours, theirs = _compare(call, gloo, args.repeats)
            if world.rank == 0:
                rows.append([f"{mb:g}", name, f"{ours[0]:.2f} / {ours[1]:.2f}",
                             f"{theirs[0]:.2f} / {theirs[1]:.2f}", f"{ours[0] / theirs[0]:.2f}"])
                print(f"{mb:>5g} {name:<15} {ours[0]:>7.2f} / {ours[1]:>6.2f} "
                      f"{theirs[0]:>7.2f} / {theirs[1]:>6.2f} {ours[0] / theirs[0]:>10.2f}", flush=True)
    if world.rank == 0 and args.out is not None:
        cores = "one core each, threads pinned" if core is not None else "threads not pinned (fewer cores than ranks)"
        write_table(args.out, columns=["MB", "collective", "DSpark default: ms wall / ms CPU",
                                       "gloo: ms wall / ms CPU", "wall ratio"], rows=rows,
                    caption=f"{n} ranks on one machine, {cores}; DSpark's default group through "
                            f"{comm.transport()!r}, a side group through 'gloo', the two alternating "
                            f"call by call. Messages of MB (10^6 bytes) of fp32; all_gather's "
                            f"shard and reduce_scatter's output are 1/{n} of it. Median of {args.repeats} "
                            f"calls after 3 warm-up calls, rank 0's wall time and its process's CPU time "
                            f"(gloo's threads included); wall ratio = DSpark default / gloo.")
    comm.destroy_group(gloo)
    dspark.shutdown()


if __name__ == "__main__":
    main()
