"""Interleaved rounds for the benchmark scripts: every choice measured once per round, the order
rotating from round to round so that drift over the run does not favour one of them; rank 0 prints
each measurement and, at the end, each choice's median over the rounds."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping


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
