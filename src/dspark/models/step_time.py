"""One-process training-step timing of a workload: how the CPU presets were sized.

This is not the benchmark lab (``dspark bench`` measures N ranks, with the engine); it times the
plain loop ``forward -> loss -> backward -> AdamW step`` in this process, to pick a preset's size
and default precision. Run it with one thread per process, as a DSpark worker has::

    OMP_NUM_THREADS=1 .venv/bin/python -m dspark.models.step_time resnet50-cpu gpt2-cpu
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.models.registry import WORKLOADS, get_workload
from dspark.models.workload import Workload

__all__ = ["StepTime", "time_training_step"]

log = logging.getLogger(__name__)

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTime:
    """Timed steps of one workload at one precision and batch."""

    workload: str
    precision: str
    global_batch: int
    step_ms: tuple[float, ...]
    """Every timed step, in order."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def best_ms(self) -> float:
        """The fastest step: on a shared machine, the one least disturbed by other processes."""
        return min(self.step_ms)


def time_training_step(workload: Workload, *, precision: str, global_batch: int | None = None,
                       warmup_steps: int = 2, measure_steps: int = 5) -> StepTime:
    """Time ``measure_steps`` training steps (after ``warmup_steps``) on the CPU in this process.

    ``precision`` is ``"fp32"`` or an autocast dtype (``"bf16"``, ``"fp16"``); the batch is fixed
    so that only compute is timed.

    Example::

        t = time_training_step(get_workload("gpt2-cpu"), precision="bf16", measure_steps=3)
        t.median_ms
    """
    if precision not in _AUTOCAST:
        raise ValueError(f"precision={precision!r} is not one of {tuple(_AUTOCAST)}")
    if warmup_steps < 0 or measure_steps < 1:
        raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0 and "
                         f"measure_steps={measure_steps!r} >= 1")
    batch = workload.default_global_batch if global_batch is None else global_batch
    model = workload.build_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = workload.make_batch(batch, seed=0)
    dtype = _AUTOCAST[precision]
    times_ms: list[float] = []
    for step in range(warmup_steps + measure_steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            output = model(inputs)
        loss = workload.loss(output, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= warmup_steps:
            times_ms.append((time.perf_counter() - start) * 1e3)
    return StepTime(workload=workload.name, precision=precision, global_batch=batch,
                    step_ms=tuple(times_ms))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark.models.step_time",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("workloads", nargs="+", choices=sorted(WORKLOADS), metavar="WORKLOAD")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=list(_AUTOCAST))
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    for name in args.workloads:
        for precision in args.precision:
            t = time_training_step(get_workload(name), precision=precision,
                                   global_batch=args.global_batch, measure_steps=args.steps)
            log.info("%-14s %-5s batch %4d: median %7.1f ms, best %7.1f ms (%d threads)",
                     t.workload, t.precision, t.global_batch, t.median_ms, t.best_ms,
                     torch.get_num_threads())


if __name__ == "__main__":
    main()
