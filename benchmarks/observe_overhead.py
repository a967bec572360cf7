"""What leaving the step breakdown and the batch fingerprint on costs: ``engine.step_stats()`` and
``engine.audit()`` need them on every step, so they are always on when this is small.

Run on an idle machine (figures move with load; see docs/observe.md)::

    OMP_NUM_THREADS=1 .venv/bin/dspark run --nproc 2 benchmarks/observe_overhead.py \
        --workload tiny gpt2-cpu --strategy zero2 --steps 40

Two measurements per workload, printed by rank 0:

1. *direct*: the observer's own calls for one step, timed in a loop: every phase's enter/leave and
   every wait's two clock marks, as many as a real step of this workload makes (counted from it),
   plus the fingerprint of this rank's batch;
2. *A/B*: training steps alternately with the observer on and with it off (a no-op observer and no
   fingerprint, what the engine would do without them), in blocks of 2 steps, median step time of
   each. The difference is within noise unless it exceeds the two medians' spread.

``--out DIR`` writes the printed figures as ``DIR/table.json`` for docs/figures.md (rank 0; see
[Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dspark
from dspark import comm
from dspark.bench.artifacts.table import write_table
from dspark.engine.for_the_lab import ForwardInputs, StepObserver, engine_parts

_BLOCK = 2
_DIRECT_REPEATS = 2000


def _enter_off(self: StepObserver, phase: int) -> None:
    """The engine without observation: phases (and so waits) cost nothing."""


def _leave_off(self: StepObserver, *, failed: bool = False, ends_step: bool = False) -> None:
    pass


def _tiny() -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Callable[..., Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)

    return model, batch, nn.functional.mse_loss


def _workload(name: str) -> tuple[nn.Module, Callable[[int], Any], Callable[..., Any], str]:
    if name == "tiny":
        return (*_tiny(), "fp32")
    from dspark.models import get_workload

    workload = get_workload(name)
    model = workload.build_model(seed=0)
    return (model, lambda step: workload.make_batch(workload.default_global_batch, seed=step),
            workload.loss, workload.default_precision)


def _time_step(engine: dspark.Engine, batch: Any, loss_fn: Callable[..., Any]) -> float:
    x, y = dspark.distribute_batch(batch, shard_dim=0)
    comm.barrier()
    start = time.perf_counter()
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    return (time.perf_counter() - start) * 1e3


def _direct_us(observer: StepObserver, phases: int, waits: int,
               batch_leaves: list[torch.Tensor]) -> tuple[float, float]:
    """Microseconds per step of the observer's calls (``phases`` phases, ``waits`` waits) and of the
    batch fingerprint."""
    def nothing() -> None:
        pass

    start = time.perf_counter()
    for _ in range(_DIRECT_REPEATS):
        for phase in range(phases):
            observer.enter(min(phase, 2))
            for _ in range(waits // phases + (phase < waits % phases)):
                observer.wait("all_reduce", None, nothing)
            observer.leave(ends_step=phase == phases - 1)
    middle = time.perf_counter()
    for _ in range(_DIRECT_REPEATS):
        ForwardInputs.of(batch_leaves)
    end = time.perf_counter()
    return (middle - start) / _DIRECT_REPEATS * 1e6, (end - middle) / _DIRECT_REPEATS * 1e6


def measure(name: str, strategy: str, steps: int) -> dict[str, float]:
    model, make_batch, loss_fn, precision = _workload(name)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                           strategy=strategy, precision=precision)
    observer = engine_parts(engine).observer
    enter, leave = StepObserver.enter, StepObserver.leave
    record = ForwardInputs.__dict__["of"]  # the classmethod itself
    off = staticmethod(lambda batch: ForwardInputs(()))  # nothing recorded
    for step in range(2):  # warm-up; the first step also learns the bucket order
        _time_step(engine, make_batch(step), loss_fn)
    phases, waits = observer.last_step_counts()
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for block in range(steps // _BLOCK):
            observing = block % 2 == 0
            StepObserver.enter = enter if observing else _enter_off  # type: ignore[method-assign]
            StepObserver.leave = leave if observing else _leave_off  # type: ignore[method-assign]
            ForwardInputs.of = record if observing else off  # type: ignore[method-assign]
            for step in range(_BLOCK):
                times[observing].append(_time_step(engine, make_batch(100 + block * _BLOCK + step), loss_fn))
    finally:
        StepObserver.enter, StepObserver.leave = enter, leave  # type: ignore[method-assign]
        ForwardInputs.of = record  # type: ignore[method-assign]
    x, _ = dspark.distribute_batch(make_batch(0), shard_dim=0)
    observer_us, fingerprint_us = _direct_us(StepObserver(torch.device("cpu"), rank=0), phases, waits, [x])
    engine.close()
    summary = torch.tensor([statistics.median(times[True]), statistics.median(times[False]), observer_us,
                            fingerprint_us], dtype=torch.float64)
    comm.all_reduce(summary, op="max")  # the slowest rank's
    on_ms, off_ms, observer_us, fingerprint_us = summary.tolist()
    spread = statistics.pstdev(times[True] + times[False])
    return {"on_ms": on_ms, "off_ms": off_ms, "observer_us": observer_us, "fingerprint_us": fingerprint_us,
            "phases": phases, "waits": waits, "spread_ms": spread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="+", default=["tiny", "gpt2-cpu"],
                        help="'tiny' (a 7k-parameter MLP: the worst case) or a dspark bench workload")
    parser.add_argument("--strategy", default="zero2")
    parser.add_argument("--steps", type=int, default=40, help="timed steps, half with the observer off")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    args = parser.parse_args()
    if args.steps < 2 * _BLOCK:
        raise SystemExit(f"--steps {args.steps}: at least {2 * _BLOCK} (a block of {_BLOCK} steps with "
                         f"the observer on and one with it off)")
    torch.set_num_threads(1)
    world = dspark.init()
    rows = []
    for name in args.workload:
        r = measure(name, args.strategy, args.steps)
        direct_us = r["observer_us"] + r["fingerprint_us"]
        row = [name, f"{direct_us:.1f}", f"{r['observer_us']:.1f}", f"{r['phases']:.0f}", f"{r['waits']:.0f}",
               f"{r['fingerprint_us']:.1f}", f"{direct_us / 1e3 / r['off_ms'] * 100:.3f}%",
               f"{r['on_ms']:.2f}", f"{r['off_ms']:.2f}", f"{(r['on_ms'] / r['off_ms'] - 1) * 100:+.1f}%",
               f"{r['spread_ms']:.2f}"]
        rows.append(row)
        if world.is_main:
            (_, direct, observer, phases, waits, fingerprint, share, on, off, change, spread) = row
            print(f"{name:>12} {args.strategy} on {world.world_size} rank(s): direct {direct} us per "
                  f"step (observer {observer} us for {phases} phases and {waits} waits, fingerprint "
                  f"{fingerprint} us) = {share} of a {off} ms step; A/B median on {on} ms, off {off} ms "
                  f"({change}, step spread {spread} ms)", flush=True)
    if world.is_main and args.out is not None:
        timed = args.steps // _BLOCK * _BLOCK
        write_table(args.out, columns=["workload", "direct us/step", "observer us", "phases", "waits",
                                       "fingerprint us", "direct % of step", "A/B on ms", "A/B off ms",
                                       "on vs off", "step spread ms"],
                    rows=rows,
                    caption=f"Strategy {args.strategy}, AdamW, {world.world_size} rank(s), one thread "
                            f"each; tiny is the script's small MLP in fp32, any other workload is dspark "
                            "bench's at its default global batch and precision. Direct: the observer's "
                            "calls for one step (as many phases and waits "
                            f"as a real step of the workload makes) and the fingerprint of this rank's "
                            f"batch, each the mean of {_DIRECT_REPEATS} repeats, microseconds; % of the "
                            f"median step with the observer off. A/B: {timed} timed steps after 2 "
                            f"warm-up steps, in alternating blocks of {_BLOCK} with the observer on and "
                            f"off, the median step of each in milliseconds (both the slowest rank's); "
                            f"the difference is within noise unless it exceeds the step spread (rank "
                            f"0's standard deviation of all {timed} steps).")
    dspark.shutdown()

if __name__ == "__main__":
    main()
