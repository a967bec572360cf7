"""What the checks of DDP habits cost a step (issue 37), each measured alone on the engine's own objects.

    OMP_NUM_THREADS=1 dspark run --nproc 2 benchmarks/ddp_habit_checks.py --workload gpt2-cpu --strategy zero2
    OMP_NUM_THREADS=1 dspark run --nproc 2 benchmarks/ddp_habit_checks.py --workload resnet50-cpu --strategy zero3

The checks that run every step, on every rank:

- the loss check (see [Note: a loss divided by the accumulation count] in dspark.engine.loss_graph):
  a few attributes of the loss's autograd root, once per ``backward()``; timed on the workload's real
  loss and on that loss divided by the count (the longest path: it reads the saved constant);
- the hyper-parameter fingerprint (see [Note: hyper-parameters in step] in dspark.engine.hyperparams):
  the optimizer's param groups hashed once per step; the fingerprint rides in the reduction's small
  vector, one float64 per rank more (no collective of its own);
- the gradient stand-ins under zero2/zero3 (see [Note: a clip of the module's parameters] in
  dspark.engine.sharded_grad): one storage-less tensor per parameter, once per step.

The loader's pass check adds two int64 to the all-gather each pass already makes, and the optimizer's
state-dict guard runs only when ``state_dict()`` is called: nothing per step. Each part is the median
of ``--repeats`` calls (rank 0's); the step is the median of ``--steps`` whole steps (forward,
``grad_accum_steps`` backward calls, step) of the same engine, the slowest rank's. ``--out DIR``
writes ``DIR/table.json`` for docs/figures.md (see [Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import dspark
from dspark import comm
from dspark.engine.for_the_lab import ShardedGradMarks, accum_scaling
from dspark.engine.for_the_lab import hyperparameter_fingerprint as fingerprint
from dspark.models import get_workload

ACCUM = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["gpt2-cpu:zero2", "resnet50-cpu:zero3", "gpt2-cpu:replicate"],
                        help="WORKLOAD:STRATEGY pairs (dspark.models workloads), measured one after the other")
    parser.add_argument("--steps", type=int, default=20, help="timed whole steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2000, help="calls of each check timed")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    return parser.parse_args()


def _median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(workload_name: str, strategy: str, args: argparse.Namespace, world: Any) -> dict[str, Any]:
    """One workload and strategy: the step's median, and each check's."""
    workload = get_workload(workload_name)

    def make_batch(step: int) -> Any:
        return workload.make_batch(workload.default_global_batch, seed=step, device=world.device)

    engine = dspark.Engine(workload.build_model(seed=0, device=world.device),
                           optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                           strategy=strategy, grad_accum_steps=ACCUM)
    step_ms = []
    for i in range(args.warmup + args.steps):
        comm.barrier()
        start = time.perf_counter()
        for x, y in engine.micro_batches(dspark.distribute_batch(make_batch(i), shard_dim=0)):
            engine.backward(workload.loss(engine(x), y))
        engine.step()
        if i >= args.warmup:
            step_ms.append((time.perf_counter() - start) * 1e3)
    slowest = torch.tensor([statistics.median(step_ms)], dtype=torch.float64)
    comm.all_reduce(slowest, op="max")

    x, y = engine.micro_batches(dspark.distribute_batch(make_batch(0), shard_dim=0))[0]
    loss = workload.loss(engine(x), y)
    divided = loss / ACCUM
    loss_us = max(_median_us(lambda: accum_scaling(loss, ACCUM), args.repeats),
                  _median_us(lambda: accum_scaling(divided, ACCUM), args.repeats))
    fingerprint_us = _median_us(lambda: fingerprint(engine.optimizer), args.repeats)
    stand_ins_us = 0.0
    if strategy in ("zero2", "zero3"):
        marks = ShardedGradMarks(engine.slots, strategy=strategy, rank=world.rank)

        def stand_ins() -> None:
            marks.install()
            for slot in engine.slots:
                slot.param.grad = None
        stand_ins_us = _median_us(stand_ins, max(1, args.repeats // 10))
    engine.close()
    comm.barrier()  # the next run's engine starts together
    checks_us = ACCUM * loss_us + fingerprint_us + stand_ins_us
    step_at = float(slowest.item())
    return {"workload": workload_name, "strategy": strategy, "world_size": world.world_size,
            "parameters": len(engine.slots), "step_ms": round(step_at, 3),
            "loss_check_us_per_backward": round(loss_us, 2), "fingerprint_us_per_step": round(fingerprint_us, 2),
            "stand_ins_us_per_step": round(stand_ins_us, 2), "checks_us_per_step": round(checks_us, 2),
            "share_of_step_percent": round(100 * checks_us / (step_at * 1e3), 4)}


def main() -> None:
    args = parse_args()
    world = dspark.init()
    torch.set_num_threads(1)
    results = []
    for run in args.runs:
        workload_name, _, strategy = run.partition(":")
        results.append(measure(workload_name, strategy or "zero2", args, world))
        if world.is_main:
            print(json.dumps(results[-1]), flush=True)
    if world.is_main and args.out is not None:
        from dspark.bench.artifacts.table import write_table

        keys = ["workload", "strategy", "parameters", "step_ms", "loss_check_us_per_backward",
                "fingerprint_us_per_step", "stand_ins_us_per_step", "checks_us_per_step", "share_of_step_percent"]
        write_table(args.out, columns=["workload", "strategy", "parameters", "step ms", "loss check us per backward",
                                       "fingerprint us per step", "gradient stand-ins us per step",
                                       "checks us per step", "share of the step %"],
                    rows=[[str(r[k]) for k in keys] for r in results],
                    caption=f"{world.world_size} ranks on {world.device.type}, fp32, AdamW, "
                            f"grad_accum_steps={ACCUM}. Each check: the median of {args.repeats} calls on "
                            "rank 0 (the loss check: the longer of the workload's loss and that loss divided "
                            f"by the count; the stand-ins, zero2/zero3 only: {max(1, args.repeats // 10)} "
                            f"calls, set and cleared). Per step: {ACCUM} loss checks, one fingerprint, the "
                            f"stand-ins. The step: the median of {args.steps} whole steps, the slowest rank's.")
    dspark.shutdown()


if __name__ == "__main__":
    main()
