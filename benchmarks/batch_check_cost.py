"""What the engine's replicated-batch check costs: one training step with the check against one
without, on a benchmark workload, plus the check's two parts timed alone.

    dspark run --nproc 2 benchmarks/batch_check_cost.py --workload gpt2-cpu --steps 20

Two engines train the same model side by side, one checking every step (``batch_check_every=1``,
the worst case) and one with the check off; their steps take turns (A B, B A, ...) so that
machine noise, and the cost of stepping first after a new batch, fall on both alike. Rank 0 prints
one JSON line: the median step of each, the difference, and the median time of a fingerprint of this
rank's batch and of the all-gather that compares them. With the default ``batch_check_every=1000``
the per-step cost is one check (fingerprint and all-gather) divided by 1000: the steps' difference
is printed too, but a check's cost is far below a step's noise, so that difference is noise of
either sign. ``--out DIR`` writes the same figures as ``DIR/table.json`` for docs/figures.md (see
[Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path
from typing import Any

import torch

import dspark
from dspark import comm
from dspark.bench.artifacts.table import write_table
from dspark.bench.measure.barrier_timing import barrier_timed_ms
from dspark.bench.measure.rounds import round_order
from dspark.engine.for_the_lab import batch_fingerprint
from dspark.models import get_workload


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-cpu", help="a name from dspark.models.WORKLOADS")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the workload's")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each engine")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    world = dspark.init()
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # one worker = one core
    workload = get_workload(args.workload)
    global_batch = args.global_batch or workload.default_global_batch
    factory = functools.partial(torch.optim.AdamW, lr=1e-4)
    engines = {every: dspark.Engine(workload.build_model(seed=0, device=world.device), optimizer=factory,
                                    batch_check_every=every)
               for every in (1, None)}

    def step(engine: dspark.Engine, batch: tuple[torch.Tensor, ...]) -> None:
        inputs, targets = batch
        engine.backward(workload.loss(engine(inputs), targets))
        engine.step()

    step_ms: dict[Any, list[float]] = {1: [], None: []}
    fingerprint_ms, gather_ms = [], []
    for i in range(args.warmup + args.steps):
        whole = workload.make_batch(global_batch, seed=i, device=world.device)
        batch = tuple(t.clone() for t in dspark.distribute_batch(whole, shard_dim=0))
        # A B, then B A: the engine that steps first after a new batch is made pays for it (a cold
        # cache, fresh allocations), so a fixed order charged that to the checking engine every step
        for every in round_order(list(engines), i):
            elapsed = barrier_timed_ms(functools.partial(step, engines[every], batch), world.device)
            if i >= args.warmup:
                step_ms[every].append(elapsed)
        fp = batch_fingerprint(batch, device=world.device)
        if i >= args.warmup:
            fingerprint_ms.append(barrier_timed_ms(
                functools.partial(batch_fingerprint, batch, device=world.device), world.device))
            gather_ms.append(barrier_timed_ms(functools.partial(comm.all_gather, fp), world.device))

    checks = engines[1].batch_check.checks
    strategy, precision = engines[1].strategy.name, engines[1].precision.name
    for engine in engines.values():
        engine.close()
    if world.is_main:
        with_ms, without_ms = statistics.median(step_ms[1]), statistics.median(step_ms[None])
        result = {
            "workload": args.workload, "world_size": world.world_size, "global_batch": global_batch,
            "device": str(world.device), "steps": args.steps, "checks_run": checks,
            "step_ms_with_check": round(with_ms, 3), "step_ms_without_check": round(without_ms, 3),
            "difference_ms": round(with_ms - without_ms, 3),
            "fingerprint_ms": round(statistics.median(fingerprint_ms), 4),
            "all_gather_ms": round(statistics.median(gather_ms), 4),
            "per_step_ms_at_default_every_1000": round(
                (statistics.median(fingerprint_ms) + statistics.median(gather_ms)) / 1000, 6),
        }
        print(json.dumps(result), flush=True)
        if args.out is not None:
            figures = {"step ms, checking every step": "step_ms_with_check",
                       "step ms, check off": "step_ms_without_check", "difference ms": "difference_ms",
                       "fingerprint ms": "fingerprint_ms", "all-gather ms": "all_gather_ms",
                       "per step ms at batch_check_every=1000": "per_step_ms_at_default_every_1000"}
            write_table(args.out, columns=["workload", "global batch", *figures],
                        rows=[[args.workload, global_batch,
                               *(json.dumps(result[key]) for key in figures.values())]],
                        caption=f"{world.world_size} ranks on {world.device.type}, {strategy}, {precision}, "
                                f"AdamW, each rank its own shard of the batch; two engines in the same "
                                f"processes, one checking the batch every step (batch_check_every=1, the "
                                f"worst case, {checks} checks run) and one with the check off, their "
                                f"steps taking turns (A B, B A, ...) after {args.warmup} "
                                f"warm-up steps; rank 0's medians of {args.steps} timed steps of "
                                f"each, milliseconds. Fingerprint: of this rank's batch; all-gather: the one "
                                f"that compares the fingerprints; each the median of {args.steps}. Per "
                                f"step at the default: (fingerprint + all-gather) / 1000; the steps' difference "
                                f"is within their noise.")
    dspark.shutdown()


if __name__ == "__main__":
    main()
