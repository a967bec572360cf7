"""Interleaved rounds for the benchmark scripts: every choice measured once per round, the order
rotating from round to round so that drift over the run does not favour one of them; rank 0 prints
each measurement and, at the end, each choice's median over the rounds."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from dspark import comm, get_world


def interleaved_medians(measure: Mapping[str, Callable[[], tuple[str, float]]], rounds: int, *,
                        verbose: bool) -> dict[str, list[float]]:
    """Call ``measure[name]()`` -> ``(detail, ms)`` for every name in every round; returns the ms of
    every round by name and, with ``verbose``, prints them as they come and the medians at the end.

    Example::

        interleaved_medians({"a": lambda: ("", step_a()), "b": lambda: ("", step_b())}, 3, verbose=True)
    """
    names = list(measure)
    values: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            detail, ms = measure[name]()
            values[name].append(ms)
            if verbose:
                print(f"round {round_index}: {name}{detail}: {ms:.1f} ms", flush=True)
    if verbose:
        for name, ms in values.items():
            print(f"{name}: median step {statistics.median(ms):.1f} ms "
                  f"(rounds {min(ms):.1f}-{max(ms):.1f})")
    return values


def median_step_ms(engine: Any, workload: Any, global_batch: int, steps: int, warmup: int) -> float:
    """Train ``engine`` on this rank's rows of ``workload``'s batch: ``warmup`` untimed steps, then
    the median of ``steps`` timed ones (each after a barrier, so that every rank starts together).
    Closes the engine afterwards and collects the garbage, so that the next choice starts clean.

    Example::

        median_step_ms(dspark.Engine(model, optimizer=opt), get_workload("gpt2-cpu"), 32, 5, 2)
    """
    world = get_world()
    inputs, targets = workload.make_batch(global_batch, seed=0)
    share = global_batch // world.world_size
    rows = slice(world.rank * share, (world.rank + 1) * share)
    x, y = inputs[rows], targets[rows]
    times = []
    for step in range(warmup + steps):
        comm.barrier()
        start = time.perf_counter()
        engine.backward(workload.loss(engine(x), y))
        engine.step()
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    engine.close()
    gc.collect()
    return statistics.median(times)


def median_call_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall ms of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones, every call
    started together on all ranks (a barrier before each)."""
    for _ in range(warmup):  # the first calls of a kind also set up gloo's buffers and pairs
        fn()
    times = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
