"""What the check for non-finite gradients costs a step: the engine with ``skip_nonfinite=True``
against one with it off, on a benchmark workload, plus the check's parts timed alone.

    dspark run --nproc 2 benchmarks/nonfinite_check_cost.py --workload gpt2-cpu --strategies replicate,zero2

The check rides in the reduction (see [Note: non-finite gradients found in the reduction] in
src/dspark/engine/finite_check.py): the pass that scales the reduced gradients into their mean
becomes PyTorch's fused scale-and-check kernel, and zero2/zero3 all-reduce the one-element flag. So
its cost is (the fused pass - the plain scaling pass) over this rank's reduced gradients, in
buckets of the engine's size, plus the flag's all-reduce for sharded gradients. Both passes run
over buffers of the same sizes, taking turns; each figure is the median of ``--steps``. The two
engines' steps (taking turns too, A B, B A, ...) are printed beside them with their spread (the
interquartile range): the check's cost is far below a step's noise on a loaded machine, so compare
their difference with the spread. Rank 0 prints one JSON line per
strategy; ``--out DIR`` writes them as ``DIR/table.json`` for docs/figures.md (see [Note: table
artifacts]).
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
from dspark.engine.for_the_lab import new_flag, scale_and_check
from dspark.models import get_workload

BUCKET_MB = 25.0  # the engine's default bucket size
FLAG_REPEATS = 50  # one flag all-reduce is far below a timer's and a barrier's noise: time 50 in a row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-cpu", help="a name from dspark.models.WORKLOADS")
    parser.add_argument("--strategies", default="replicate,zero2", help="comma-separated")
    parser.add_argument("--precision", default=None, help="default: the workload's own (the quick suite's)")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the workload's")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each engine")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    return parser.parse_args()


def _reduced_buffers(model: torch.nn.Module, *, sharded: bool, world: dspark.World) -> list[torch.Tensor]:
    """Buffers the size of what this rank's reduction scales: every gradient (replicate, zero1) or
    its 1/N shard (zero2, zero3), in buckets of about ``BUCKET_MB``."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if sharded:
        numel = -(-numel // world.world_size)
    per_bucket = int(BUCKET_MB * 2**20) // 4
    sizes = [min(per_bucket, numel - at) for at in range(0, numel, per_bucket)]
    return [torch.randn(n, device=world.device) for n in sizes]


def _interquartile(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def _flag_all_reduces(flag: torch.Tensor) -> None:
    for _ in range(FLAG_REPEATS):
        comm.all_reduce(flag, op="max")


def measure(workload_name: str, strategy: str, precision: str | None, steps: int,
            warmup: int, global_batch: int | None = None) -> dict[str, Any]:
    world = dspark.get_world()
    workload = get_workload(workload_name)
    factory = functools.partial(torch.optim.AdamW, lr=1e-4)
    engines = {on: dspark.Engine(workload.build_model(seed=0, device=world.device), optimizer=factory,
                                 strategy=strategy, skip_nonfinite=on,
                                 precision=precision or workload.default_precision)
               for on in (True, False)}
    sharded = engines[True].strategy.shard_grads and world.world_size > 1
    precision = engines[True].precision.name
    buffers = _reduced_buffers(engines[True].module, sharded=sharded, world=world)

    def step(engine: dspark.Engine, batch: tuple[torch.Tensor, ...]) -> None:
        inputs, targets = batch
        engine.backward(workload.loss(engine(inputs), targets))
        engine.step()

    step_ms: dict[bool, list[float]] = {True: [], False: []}
    plain_ms, fused_ms, flag_ms = [], [], []
    flag = new_flag(world.device)
    for i in range(warmup + steps):
        whole = workload.make_batch(global_batch or workload.default_global_batch, seed=i, device=world.device)
        batch = tuple(t.clone() for t in dspark.distribute_batch(whole, shard_dim=0))
        order = round_order([True, False], i)
        for on in order:
            elapsed = barrier_timed_ms(functools.partial(step, engines[on], batch), world.device)
            if i >= warmup:
                step_ms[on].append(elapsed)
        for fused in order:  # the two passes take turns too
            elapsed = barrier_timed_ms(functools.partial(scale_and_check, buffers, 1.0 / world.world_size,
                                                  flag if fused else None), world.device)
            if i >= warmup:
                (fused_ms if fused else plain_ms).append(elapsed)
        if sharded:
            elapsed = barrier_timed_ms(functools.partial(_flag_all_reduces, flag), world.device)
            if i >= warmup:
                flag_ms.append(elapsed / FLAG_REPEATS)
    for engine in engines.values():
        engine.close()
    medians = [statistics.median(values) if values else 0.0
               for values in (step_ms[True], step_ms[False], plain_ms, fused_ms, flag_ms)]
    spreads = [_interquartile(step_ms[True]), _interquartile(step_ms[False])]
    summary = torch.tensor(medians + spreads, dtype=torch.float64)
    comm.all_reduce(summary, op="max")  # the slowest rank's
    on_ms, off_ms, plain, fused, flag_all_reduce, on_spread_ms, off_spread_ms = summary.tolist()
    return {"workload": workload_name, "strategy": strategy, "precision": precision,
            "world_size": world.world_size, "steps": steps,
            "reduced_gradient_bytes": sum(b.numel() * b.element_size() for b in buffers),
            "step_ms_skip_nonfinite_on": round(on_ms, 3), "step_ms_skip_nonfinite_off": round(off_ms, 3),
            "step_ms_spread_on": round(on_spread_ms, 3), "step_ms_spread_off": round(off_spread_ms, 3),
            "scale_pass_ms": round(plain, 4), "scale_and_check_pass_ms": round(fused, 4),
            "flag_all_reduce_ms": round(flag_all_reduce, 4),
            "check_ms_per_step": round(fused - plain + flag_all_reduce, 4)}


def main() -> None:
    args = parse_args()
    world = dspark.init()
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # one worker = one core
    results = [measure(args.workload, s, args.precision, args.steps, args.warmup, args.global_batch)
               for s in args.strategies.split(",")]
    if world.is_main:
        for result in results:
            print(json.dumps(result), flush=True)
        if args.out is not None:
            figures = {"reduced gradients MB": "reduced_gradient_bytes",
                       "scale pass ms": "scale_pass_ms", "scale-and-check pass ms": "scale_and_check_pass_ms",
                       "flag all-reduce ms": "flag_all_reduce_ms", "check ms per step": "check_ms_per_step",
                       "step ms, check on": "step_ms_skip_nonfinite_on",
                       "step ms, check off": "step_ms_skip_nonfinite_off",
                       "step spread ms, on": "step_ms_spread_on", "step spread ms, off": "step_ms_spread_off"}
            rows = [[r["workload"], r["strategy"], r["precision"],
                     *(f"{r[key] / 1e6:.1f}" if key.endswith("bytes") else json.dumps(r[key])
                       for key in figures.values())] for r in results]
            batch = "the workload's" if args.global_batch is None else f"a {args.global_batch}-sample"
            write_table(args.out, columns=["workload", "strategy", "precision", *figures], rows=rows,
                        caption=f"{world.world_size} ranks on {world.device.type}, AdamW, {batch} "
                                f"global batch split over the ranks. The check's parts, over this rank's "
                                f"reduced gradients in {BUCKET_MB:g} MB buckets: the plain scaling pass "
                                f"and the fused scale-and-check pass that replaces it, taking turns, and "
                                f"(zero2/zero3) the one-element flag's all-reduce (the mean of "
                                f"{FLAG_REPEATS} in a row); check per step = fused - plain + all-reduce. "
                                "Steps: two engines, skip_nonfinite on and off, "
                                f"taking turns (A B, B A, ...) after {args.warmup} warm-up steps; their "
                                "difference is the check's cost plus the machine's noise: compare it with "
                                "each engine's spread (the interquartile range of its steps). Medians of "
                                f"{args.steps}, the slowest rank's, milliseconds.")
    dspark.shutdown()


if __name__ == "__main__":
    main()
