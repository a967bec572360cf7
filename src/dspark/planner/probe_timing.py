"""The probe's step times: rounds repeated until they are steady, fits that never promise more than
linear speed-up, and the spread the rounds leave as each prediction's interval.

[Note: steady steps] One short measurement of a step moves with whatever else the machine runs:
the same probe minutes apart predicted one MLP's 2-rank step at more than twice its own earlier
figure on a shared 2-core machine. So the probe times in *rounds*: each round runs ``steps`` steps
at each of its two batch sizes, in turn (the two sizes see the same machine), and keeps their
medians. After
:data:`MIN_ROUNDS` rounds it stops as soon as the last :data:`MIN_ROUNDS` rounds' step at the larger
batch lies within :data:`STEADY_SPREAD` of their median (range over median); else it goes on, to
:data:`MAX_ROUNDS` or :data:`MAX_SECONDS`, and then says it is not steady, with the spread it
measured: a busy machine is reported, not averaged away. The lines come from the medians over the
rounds kept (the last :data:`MIN_ROUNDS`, or all of them when not steady).

A line ``fixed + per_sample x batch`` with a negative ``fixed`` predicts that ``N`` ranks with
``1/N`` of the batch each finish in less than ``1/N`` of the time: more than linear speed-up, which
a data-parallel step cannot have (a conv net's probe once implied more than twice one rank's speed on
2 ranks). Such a fit is
refused: the part is taken as proportional to the batch through the larger batch's time, and the
probe names it (``Probe.refused_fits``).

Each round also gives its own lines; every row's step is predicted with each round's too, and the
lowest and highest of those are the row's interval (``step_ms_low``, ``step_ms_high``): what the
probe's own rounds say about how sure it is. The link's terms are the link probe's, one value each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark.planner.probe_record import Line

__all__ = ["MAX_ROUNDS", "MAX_SECONDS", "MIN_ROUNDS", "STEADY_SPREAD", "StepTiming", "time_line", "time_rounds"]

STEADY_SPREAD = 0.05
"""Rounds whose steps at the larger batch lie within this share of their median are steady."""
MIN_ROUNDS = 3
"""Rounds always timed, and the window whose spread says whether they are steady."""
MAX_ROUNDS = 6
"""At most this many rounds."""
MAX_SECONDS = 60.0
"""No new round starts after this long: a slow model on a busy machine is not timed for ever."""


def time_line(points: Sequence[tuple[int, float]]) -> tuple[Line, bool]:
    """A time measured at two batch sizes as ``fixed + per_sample x batch``, and whether the fit was
    refused for implying more than linear speed-up (a negative ``fixed``; see [Note: steady steps]):
    then proportional to the batch through the larger one.

    Example::

        time_line([(2, 10.0), (8, 50.0)])   # (Line(fixed=0.0, per_sample=6.25), True)
    """
    (b0, y0), (b1, y1) = points[0], points[-1]
    per_sample = (y1 - y0) / (b1 - b0) if b1 != b0 else y1 / max(b1, 1)
    fixed = y1 - per_sample * b1
    if fixed < 0:
        return Line(fixed=0.0, per_sample=y1 / max(b1, 1)), True
    return Line(fixed=fixed, per_sample=per_sample), False


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTiming:
    """What :func:`time_rounds` measured."""

    forward_ms: Line
    backward_ms: Line
    optimizer_ms: float
    rounds: int
    steady: bool
    spread: float
    """Range over median of the kept rounds' steps at the larger batch."""
    forward_ms_rounds: tuple[Line, ...]
    backward_ms_rounds: tuple[Line, ...]
    optimizer_ms_rounds: tuple[float, ...]
    refused_fits: tuple[str, ...]


def time_rounds(step: Callable[[int], tuple[float, float, float]], batches: tuple[int, int],
                steps: int, before_round: Callable[[], None] | None = None) -> StepTiming:
    """Rounds of ``steps`` calls of ``step(rows)`` (seconds of forward, backward, optimizer) at each
    batch size, until steady (see [Note: steady steps]); ``before_round()``, untimed, before each.

    Example::

        time_rounds(lambda rows: runner.step(slice_batch(batch, rows), loss_fn)[:3], (2, 8), steps=3)
    """
    started = time.perf_counter()
    sizes = list(dict.fromkeys(batches))
    rounds: list[dict[int, tuple[float, float, float]]] = []
    steady = False
    while len(rounds) < MAX_ROUNDS:
        if before_round is not None:
            before_round()
        medians = {}
        for rows in sizes:
            times = [step(rows) for _ in range(steps)]
            medians[rows] = tuple(1e3 * statistics.median(t[i] for t in times) for i in range(3))
        rounds.append(medians)  # type: ignore[arg-type]
        if len(rounds) >= MIN_ROUNDS and _spread(rounds[-MIN_ROUNDS:], sizes[-1]) <= STEADY_SPREAD:
            steady = True
            break
        if len(rounds) >= MIN_ROUNDS and time.perf_counter() - started > MAX_SECONDS:
            break
    kept = rounds[-MIN_ROUNDS:] if steady else rounds
    refused: set[str] = set()

    def lines(part: int, window: Sequence[dict[int, tuple[float, float, float]]], *, final: bool = False) -> Line:
        points = [(rows, statistics.median(r[rows][part] for r in window)) for rows in sizes]
        line, was_refused = time_line(points)
        if was_refused and final:
            refused.add(("forward", "backward")[part])
        return line

    forward, backward = lines(0, kept, final=True), lines(1, kept, final=True)
    per_round = [(lines(0, [r]), lines(1, [r]), statistics.median(r[rows][2] for rows in sizes)) for r in kept]
    return StepTiming(forward_ms=forward, backward_ms=backward,
                      optimizer_ms=statistics.median(r[rows][2] for r in kept for rows in sizes),
                      rounds=len(rounds), steady=steady, spread=_spread(kept, sizes[-1]),
                      forward_ms_rounds=tuple(f for f, _, _ in per_round),
                      backward_ms_rounds=tuple(b for _, b, _ in per_round),
                      optimizer_ms_rounds=tuple(o for _, _, o in per_round), refused_fits=tuple(sorted(refused)))


def _spread(rounds: Sequence[dict[int, tuple[float, float, float]]], rows: int) -> float:
    totals = [sum(r[rows]) for r in rounds]
    middle = statistics.median(totals)
    return (max(totals) - min(totals)) / middle if middle > 0 else 0.0
