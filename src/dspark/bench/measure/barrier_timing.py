"""Timing one collective piece of work on every rank alike: the ranks start together (a barrier),
and a GPU's queue is drained before the clock is read on either side; and the medians the
benchmark scripts take of such timings (a call repeated, an engine's training steps).

Example::

    elapsed_ms = barrier_timed_ms(lambda: engine.step(), world.device)
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dspark import comm

__all__ = ["barrier_timed_ms", "median_call_ms", "median_step_ms", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier_timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds ``fn()`` took on this rank, every rank starting after one barrier."""
    comm.barrier()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def median_call_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median of :func:`barrier_timed_ms` of ``fn()`` over ``repeats`` calls, after ``warmup``
    untimed ones (the first calls of a collective also set up gloo's buffers and pairs).

    Example::

        median_call_ms(lambda: comm.all_reduce(bucket), repeats=30)
    """
    device = comm.get_world().device
    for _ in range(warmup):
        fn()
    return statistics.median(barrier_timed_ms(fn, device) for _ in range(repeats))


def median_step_ms(engine: Any, workload: Any, global_batch: int, steps: int, warmup: int) -> float:
    """Train ``engine`` on this rank's rows of ``workload``'s batch of ``global_batch`` samples:
    ``warmup`` untimed steps, then the median :func:`barrier_timed_ms` of ``steps`` timed ones.
    Closes the engine afterwards and collects the garbage, so that the next choice starts clean.

    Example::

        median_step_ms(dspark.Engine(model, optimizer=opt), get_workload("gpt2-cpu"), 32, 5, 2)
    """
    world = comm.get_world()
    inputs, targets = workload.make_batch(global_batch, seed=0)
    share = global_batch // world.world_size
    rows = slice(world.rank * share, (world.rank + 1) * share)
    x, y = inputs[rows].to(world.device), targets[rows].to(world.device)

    def step() -> None:
        engine.backward(workload.loss(engine(x), y))
        engine.step()

    for _ in range(warmup):
        step()
    times = [barrier_timed_ms(step, world.device) for _ in range(steps)]
    engine.close()
    gc.collect()
    return statistics.median(times)
