"""What the step's guards cost: the non-finite check (``skip_nonfinite=True``: a flag of each loss,
read with the reduction, and one of the reduced gradients, found in the pass that scales them: see
[Note: non-finite gradients found in the reduction] in dspark.engine.finite_check, and
benchmarks/nonfinite_check_cost.py for its parts) and the step tags (see [Note: ranks in step] in
dspark.engine.window), carried in the small vector the gradient reduction all-reduces anyway.

    OMP_NUM_THREADS=1 dspark run --nproc 2 benchmarks/step_guard_cost.py --workload tiny --strategy replicate
    OMP_NUM_THREADS=1 dspark run --nproc 2 benchmarks/step_guard_cost.py --workload gpt2-cpu --strategy zero2

Two engines train the same model side by side, one with ``skip_nonfinite=True`` and one with it off;
their steps alternate so that machine noise falls on both alike. Rank 0 prints one JSON line. Run
from a checkout before the guards (its ``src`` first on ``PYTHONPATH``), an engine has no
``skip_nonfinite``: both engines are then the same, and their median is that checkout's step, to
compare with this one's. ``--out DIR`` writes the medians as ``DIR/table.json`` for
docs/figures.md (see [Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dspark
from dspark import comm


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tiny", help="'tiny' (an MLP: the worst case) or a dspark.models name")
    parser.add_argument("--strategy", default="replicate")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each engine")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    return parser.parse_args()


def _workload(name: str, device: torch.device) -> tuple[Callable[[], nn.Module], Callable[[int], Any],
                                                         Callable[..., torch.Tensor], str]:
    if name == "tiny":
        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(step)
            return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)

        return build, batch, nn.functional.mse_loss, "fp32"
    from dspark.models import get_workload

    workload = get_workload(name)
    return (lambda: workload.build_model(seed=0, device=device),
            lambda step: workload.make_batch(workload.default_global_batch, seed=step, device=device),
            workload.loss, "fp32")


# This script imports nothing of the lab's (dspark.bench), so that it runs against an older checkout
# too (see the docstring): its timing and its turns are the lab's barrier_timed_ms and round_order
# written out.
def _timed_ms(fn: Callable[[], Any]) -> float:
    comm.barrier()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    args = parse_args()
    world = dspark.init()
    torch.set_num_threads(1)
    build, make_batch, loss_fn, precision = _workload(args.workload, world.device)
    has_guard = "skip_nonfinite" in inspect.signature(dspark.Engine).parameters
    factory = functools.partial(torch.optim.AdamW, lr=1e-4)
    engines = {on: dspark.Engine(build(), optimizer=factory, strategy=args.strategy, precision=precision,
                                 **({"skip_nonfinite": on} if has_guard else {}))
               for on in (True, False)}

    def step(engine: dspark.Engine, batch: Any) -> None:
        x, y = batch
        engine.backward(loss_fn(engine(x), y))
        engine.step()

    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.warmup + args.steps):
        batch = dspark.distribute_batch(make_batch(i), shard_dim=0)
        for on in ((True, False) if i % 2 else (False, True)):
            elapsed = _timed_ms(functools.partial(step, engines[on], batch))
            if i >= args.warmup:
                times[on].append(elapsed)
    for engine in engines.values():
        engine.close()
    summary = torch.tensor([statistics.median(times[True]), statistics.median(times[False])], dtype=torch.float64)
    comm.all_reduce(summary, op="max")  # the slowest rank's
    if world.is_main:
        on_ms, off_ms = summary.tolist()
        print(json.dumps({
            "workload": args.workload, "strategy": args.strategy, "world_size": world.world_size,
            "steps": args.steps,
            "engine_has_skip_nonfinite": has_guard,
            "step_ms_skip_nonfinite_on": round(on_ms, 3), "step_ms_skip_nonfinite_off": round(off_ms, 3),
            "difference_ms": round(on_ms - off_ms, 3),
            "spread_ms": round(statistics.pstdev(times[True] + times[False]), 3),
        }), flush=True)
        if args.out is not None:
            from dspark.bench.artifacts.table import write_table

            write_table(args.out, columns=["workload", "strategy", "`skip_nonfinite=True` step ms",
                                           "`skip_nonfinite=False` step ms", "spread ms"],
                        rows=[[args.workload, args.strategy, f"{on_ms:.3f}", f"{off_ms:.3f}",
                               f"{statistics.pstdev(times[True] + times[False]):.3f}"]],
                        caption=f"Median step over {args.steps} steps (the slowest rank's), the two "
                                f"engines alternating, {world.world_size} ranks; spread: the standard "
                                f"deviation of every step of both.")
    dspark.shutdown()


if __name__ == "__main__":
    main()
