"""DSpark's step beside a peer's, step by step: both engines live in the same processes and take
turns (A B, B A, A B, ...), each step started together on every rank, so that a drift of the
machine (a noisy VM's neighbour, a frequency change) falls on both sides of every pair of steps.
For each pairing it prints the median step of either engine and the median of the per-pair ratios
(DSpark / peer: below 1, DSpark is faster) with their quartiles and 10th-90th percentiles. The
second of a pair may also be another DSpark strategy (``replicate:zero3``: what zero3 costs).

    dspark run --nproc 2 benchmarks/side_by_side.py --workload resnet50-cpu \
        --pairs replicate:torch-ddp,zero2:deepspeed-zero2 --steps 40

The lab (``dspark bench --suite peers``) launches every engine in processes of its own, in rounds:
each engine runs as its users run it, but a round's engines are tens of seconds apart. Here the
engines are seconds apart and share what a process sets once: the malloc setting is DSpark's for
both (``dspark.cpu_malloc``, set by the first DSpark engine), so DDP and FSDP2 get it too, where
the lab leaves them glibc's own; each engine keeps its own optimizer kernel and collectives (the
peers as in the lab: the same factory as ``make_engine`` gives them). What is left between the two
is the engine. The same model weights and batches for both; threads are pinned one core per rank,
as in the lab. The DeepSpeed peers need ``make peers``. ``--out DIR`` writes the printed figures as
``DIR/table.json`` for docs/figures.md (rank 0; see [Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dspark
from dspark import comm
from dspark.bench.artifacts.table import write_table
from dspark.bench.measure.cpu_load import core_for_rank, pin_all_threads
from dspark.bench.measure.peers import PEERS, dspark_engine_options, make_engine
from dspark.bench.measure.rounds import round_order
from dspark.models import get_workload

DEFAULT_PAIRS = "replicate:torch-ddp,zero3:torch-fsdp2"


def _parse_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in text.split(","):
        ours, sep, theirs = item.strip().partition(":")
        if not sep or not ours or not theirs:
            raise SystemExit(f"--pairs: {item!r} is not STRATEGY:PEER, e.g. replicate:torch-ddp")
        if ours in PEERS or ours == theirs:
            raise SystemExit(f"--pairs: {item!r}: put DSpark's strategy first and a peer (or another "
                             f"DSpark strategy) second; peers: {', '.join(sorted(PEERS))}")
        pairs.append((ours, theirs))
    return pairs


class _Side:
    """One engine on this rank's rows of the workload's batches."""

    def __init__(self, strategy: str, workload: Any, precision: str, global_batch: int) -> None:
        world = dspark.get_world()
        self.strategy = strategy
        self.workload = workload
        self.global_batch = global_batch
        options = {} if strategy in PEERS else dspark_engine_options(batch_placement="shard")
        self.engine = make_engine(strategy, workload.build_model(seed=0, device=world.device), world,
                                  lr=3e-4, precision=precision, options=options,
                                  global_batch=global_batch)
        self.times: list[float] = []

    def step(self, index: int, *, timed: bool) -> None:
        world = dspark.get_world()
        inputs, targets = self.workload.make_batch(self.global_batch, seed=index, device=world.device)
        share = self.global_batch // world.world_size
        rows = slice(world.rank * share, (world.rank + 1) * share)
        x, y = inputs[rows].contiguous(), targets[rows].contiguous()
        comm.barrier()  # every rank starts the step together
        start = time.perf_counter()
        self.engine.backward(self.workload.loss(self.engine(x), y))
        self.engine.step()
        if timed:
            self.times.append((time.perf_counter() - start) * 1e3)

    def close(self) -> None:
        self.engine.close()
        self.engine = None


def _run_pair(ours: str, theirs: str, workload: Any, precision: str, global_batch: int, steps: int,
              warmup: int) -> dict[str, float]:
    sides = [_Side(ours, workload, precision, global_batch), _Side(theirs, workload, precision,
                                                                     global_batch)]
    try:
        for index in range(warmup):
            for side in sides:
                side.step(index, timed=False)
        gc.collect()
        gc.disable()  # a collection inside a timed step would be charged to that engine
        try:
            for index in range(warmup, warmup + steps):
                for side in round_order(sides, index):
                    side.step(index, timed=True)
        finally:
            gc.enable()
    finally:
        for side in sides:
            side.close()
        gc.collect()
    a, b = sides[0].times, sides[1].times
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    p10, q25, q75, p90 = (float(v) for v in np.percentile(ratios, [10, 25, 75, 90]))
    return {"ours_ms": statistics.median(a), "theirs_ms": statistics.median(b),
            "ratio": statistics.median(ratios), "q25": q25, "q75": q75, "p10": p10, "p90": p90}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="resnet50-cpu")
    parser.add_argument("--pairs", default=DEFAULT_PAIRS,
                        help=f"STRATEGY:PEER,... (default {DEFAULT_PAIRS}; DeepSpeed's: "
                             "zero1:deepspeed-zero1,zero2:deepspeed-zero2, after make peers)")
    parser.add_argument("--precision", default=None, help="fp32 or bf16 (default: the workload's)")
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    args = parser.parse_args()
    pairs = _parse_pairs(args.pairs)
    if args.steps < 2 or args.warmup < 2:
        raise SystemExit("--steps and --warmup must be at least 2 (DSpark's first step observes the "
                         "gradients' order and rebuilds its buckets)")
    workload = get_workload(args.workload)
    precision = args.precision or workload.default_precision
    global_batch = args.global_batch or workload.default_global_batch
    if not torch.cuda.is_available():
        core = core_for_rank(int(os.environ.get("LOCAL_RANK", "0")),
                             int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if core is not None:
            pin_all_threads(core)
        torch.set_num_threads(1)
    world = dspark.init()
    if global_batch % world.world_size:
        raise SystemExit(f"--global-batch {global_batch} does not divide by {world.world_size} ranks")
    rows = []
    try:
        for ours, theirs in pairs:
            r = _run_pair(ours, theirs, workload, precision, global_batch, args.steps, args.warmup)
            row = [ours, theirs, f"{r['ours_ms']:.1f}", f"{r['theirs_ms']:.1f}", f"{r['ratio']:.3f}",
                   f"{r['q25']:.3f}-{r['q75']:.3f}", f"{r['p10']:.3f}-{r['p90']:.3f}"]
            rows.append(row)
            if world.is_main:
                print(f"{args.workload} {precision} batch {global_batch} on {world.world_size} ranks: "
                      f"{ours} {row[2]} ms, {theirs} {row[3]} ms; step ratio {row[4]} (quartiles "
                      f"{row[5]}, p10-p90 {row[6]}, {args.steps} pairs)", flush=True)
        if world.is_main and args.out is not None:
            threads = "one thread per rank" if world.device.type == "cpu" else world.device.type
            write_table(args.out, columns=["DSpark", "peer", "DSpark step ms", "peer step ms",
                                           "step ratio", "ratio quartiles", "ratio p10-p90"],
                        rows=rows,
                        caption=f"{args.workload}, {precision}, global batch {global_batch}, "
                                f"{world.world_size} ranks ({threads}); both engines in the same "
                                f"processes, their steps taking turns (A B, B A, ...) after {args.warmup} "
                                f"untimed steps each; step ms: rank 0's median of {args.steps} timed "
                                f"steps of each; step ratio: the median of the {args.steps} per-pair ratios "
                                f"DSpark / peer (below 1: DSpark faster), with their quartiles and "
                                f"10th-90th percentiles.")
    finally:
        gc.collect()
        dspark.shutdown()


if __name__ == "__main__":
    main()
