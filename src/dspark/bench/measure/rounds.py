"""Interleaved rounds: the one way the lab and its benchmark scripts take turns between the choices
they compare.

[Note: interleaved rounds]
On a shared machine a core's speed drifts by more than most effects the lab measures, and the first
of a row of measurements pays for what the others then find warm. So every comparison measures each
choice once per round, in an order that rotates by one place from round to round (two choices:
A B, then B A; three: A B C, B C A, C A B): a slow spell or a cold start falls on every choice
alike over the rounds, and each choice's figure is the median over its rounds. ``dspark bench``
orders each baseline's group of launches this way (see [Note: rounds] in
:mod:`dspark.bench.ledger.measurement`), and the scripts in ``benchmarks/`` their engines, steps and
calls.

Example::

    for round_index in range(3):
        for name in round_order(["replicate", "zero3"], round_index):
            measure(name)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

__all__ = ["interleaved_rounds", "round_order"]

T = TypeVar("T")


def round_order(choices: Sequence[T], round_index: int) -> list[T]:
    """``choices`` in the order round ``round_index`` measures them (see [Note: interleaved rounds]).

    Example::

        round_order(["a", "b", "c"], 1)   # ["b", "c", "a"]
    """
    if not choices:
        return []
    shift = round_index % len(choices)
    return [*choices[shift:], *choices[:shift]]


def interleaved_rounds(measure: Mapping[str, Callable[[], tuple[str, float]]], rounds: int, *,
                       verbose: bool) -> dict[str, list[float]]:
    """Call ``measure[name]()`` -> ``(detail, ms)`` for every name in every round, in
    :func:`round_order`; return each name's ms by round. With ``verbose``, print each figure as it
    comes and each name's median over the rounds at the end (rank 0 passes ``world.is_main``).

    Example::

        interleaved_rounds({"a": lambda: ("", step_a()), "b": lambda: ("", step_b())}, 3, verbose=True)
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    values: dict[str, list[float]] = {name: [] for name in measure}
    for round_index in range(rounds):
        for name in round_order(list(measure), round_index):
            detail, ms = measure[name]()
            values[name].append(ms)
            if verbose:
                print(f"round {round_index}: {name}{detail}: {ms:.1f} ms", flush=True)
    if verbose:
        for name, ms_by_round in values.items():
            print(f"{name}: median step {statistics.median(ms_by_round):.1f} ms "
                  f"(rounds {min(ms_by_round):.1f}-{max(ms_by_round):.1f})")
    return values
