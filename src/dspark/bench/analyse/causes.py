"""Why N devices were slower than one: each candidate cause sized in milliseconds per step, ranked.

[Note: causes ranked by evidence]
``negative_scaling`` used to name the first cause on a fixed list that had any evidence at all, so
a few milliseconds of communication were blamed for a step hundreds of times longer on a machine
busy with other work, and a rank
slowed on purpose was missed. Now every cause is sized against the same thing, the time lost per
step: the N-device step minus a perfect split of the 1-device step (``step_ms - baseline / N``).

* **straggler** (with ``--profile``): the slowest rank's ``compute_ms`` minus the others' median;
  the others wait that long every step.
* **busy machine**: the largest share of a rank's timed window its core spent on other processes
  (or stolen), times that round's step: time the rank did not get.
* **replicated batch**: the compute spent on samples beyond a rank's share: ``compute_ms`` (or the
  1-device step, scaled to the rank's samples) times ``1 - share / samples``.
* **communication**: the exposed wait on collectives (``--profile``), else the wire bytes over the
  measured bus bandwidth.

The largest is named as the likely cause when it accounts for at least :data:`ACCOUNTS_FOR` of
the lost time; otherwise the message says that none does, and gives the numbers of each.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from dspark.bench.analyse.anomalies import (
    anomaly,
    devices,
    is_batch_replicated,
    model_state_excess,
    wire_bytes,
)
from dspark.bench.present.formatting import format_mb, format_ms, format_ratio
from dspark.bench.result import BenchResult

__all__ = ["ACCOUNTS_FOR", "Cause", "lost_ms", "negative_scaling", "ranked_causes"]

ACCOUNTS_FOR = 0.5
"""A cause is named as *the* likely cause when it explains at least half the lost time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cause:
    """One candidate cause, sized."""

    kind: str
    """``straggler``, ``busy_machine``, ``replicated_batch`` or ``communication``."""
    ms: float
    """Milliseconds per step it explains."""
    evidence: str
    """The measured numbers, in words."""

    def __str__(self) -> str:
        return f"{self.kind.replace('_', ' ')}: {format_ms(self.ms)} per step ({self.evidence})"


def lost_ms(result: BenchResult, baseline: BenchResult) -> float:
    """The N-device step beyond a perfect split of the 1-device step, in ms (0 at best)."""
    return max(0.0, result.step_ms - baseline.step_ms / result.num_devices)


def _compute_by_rank(result: BenchResult) -> list[float]:
    return [phases.get("compute_ms", 0.0) for phases in result.phase_ms_by_rank]


def _straggler(result: BenchResult) -> Cause | None:
    compute = _compute_by_rank(result)
    if len(compute) < 2 or min(compute) <= 0:
        return None
    slow = max(range(len(compute)), key=lambda rank: (compute[rank], -rank))
    typical = statistics.median(ms for rank, ms in enumerate(compute) if rank != slow)
    return Cause(kind="straggler", ms=compute[slow] - typical,
                 evidence=f"rank {slow} computes {format_ms(compute[slow])}, "
                          f"{format_ratio(compute[slow] / typical)} the others' {format_ms(typical)}")


def _busy_machine(result: BenchResult) -> Cause | None:
    steps = result.round_step_ms or [result.step_ms]
    shares = [(share * ms, share, index) for index, (share, ms) in enumerate(
        zip(result.core_foreign_share_by_round, steps, strict=False)) if share]
    if not shares:
        return None
    ms, share, index = max(shares)
    return Cause(kind="busy_machine", ms=ms,
                 evidence=f"in round {index} a rank's core spent {share:.0%} of its window on "
                          "other processes or stolen time")


def _replicated_batch(result: BenchResult, baseline: BenchResult) -> Cause | None:
    if not is_batch_replicated(result) or result.local_batch <= 0:
        return None
    share = result.global_batch / result.num_devices
    if result.local_batch <= share:
        return None  # identical inputs at a share's size: the compute per rank is not inflated
    extra = 1 - share / result.local_batch
    compute = [ms for ms in _compute_by_rank(result) if ms > 0]
    spent = (statistics.median(compute) if compute
             else baseline.step_ms * result.local_batch / max(baseline.global_batch, 1))
    return Cause(kind="replicated_batch", ms=spent * extra,
                 evidence=f"each rank computes {result.local_batch} samples where its share is "
                          f"{share:g}")


def _communication(result: BenchResult) -> Cause | None:
    waits = [phases.get("comm_exposed_ms", 0.0) for phases in result.phase_ms_by_rank]
    if waits:
        return Cause(kind="communication", ms=statistics.median(waits),
                     evidence="exposed wait on collectives, the ranks' median")
    wire, estimated = wire_bytes(result)
    if not wire or result.bus_bytes_per_s <= 0:
        return None
    return Cause(kind="communication", ms=wire / result.bus_bytes_per_s * 1e3,
                 evidence=f"{format_mb(wire)} on the wire{', estimated' if estimated else ''} at "
                          "the measured bus bandwidth")


def ranked_causes(result: BenchResult, baseline: BenchResult) -> list[Cause]:
    """Every cause with evidence, largest first (see [Note: causes ranked by evidence]).

    Example::

        ranked_causes(two_devices, one_device)[0].kind   # "straggler" for a rank slowed on purpose
    """
    found = [_straggler(result), _busy_machine(result), _replicated_batch(result, baseline),
             _communication(result)]
    return sorted((c for c in found if c is not None and c.ms > 0), key=lambda c: -c.ms)


def _rounds_range(result: BenchResult) -> str:
    if result.speedup_min is None or result.speedup_max is None or len(result.round_speedups) < 2:
        return ""
    return (f"; median of {len(result.round_speedups)} rounds, "
            f"{format_ratio(result.speedup_min)}-{format_ratio(result.speedup_max)}")


def negative_scaling(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """N devices took longer per step than 1 device on the same global batch (the median of the
    per-round speedups is below 1), with the cause that accounts for the lost time, or the word
    that none does (see [Note: causes ranked by evidence]).

    Example::

        negative_scaling(two_devices, one_device)
        # "2 devices are <ratio> slower than 1 (...); likely cause: replicated batch: ..."
    """
    if result.num_devices <= 1 or baseline is None or result.speedup is None or result.speedup <= 0:
        return []
    speedup = result.speedup
    if speedup >= 1:
        return []
    message = (f"{devices(result.num_devices)} are {format_ratio(1 / speedup)} slower than 1 "
               f"({format_ms(result.step_ms)} vs {format_ms(baseline.step_ms)}"
               f"{_rounds_range(result)})")
    if result.speedup_max is not None and result.speedup_max >= 1:
        message += ", and at least one round was no slower: at best no faster than 1"
    lost = lost_ms(result, baseline)
    causes = ranked_causes(result, baseline)
    lost_words = (f"{format_ms(lost)} lost per step against a perfect 1/{result.num_devices} split "
                  f"of the 1-device step")
    if causes and causes[0].ms >= ACCOUNTS_FOR * lost:
        top = causes[0]
        cause = f"{top} accounts for {min(top.ms / lost, 1.0):.0%} of the {lost_words}"
        if len(causes) > 1:
            cause += "; also measured: " + "; ".join(str(c) for c in causes[1:])
    elif causes:
        cause = (f"none of the measured causes accounts for the {lost_words}: "
                 + "; ".join(str(c) for c in causes))
        if not result.phase_ms_by_rank:
            cause += "; `dspark bench --profile` adds each rank's compute and exposed wait"
    else:
        cause = (f"nothing measured accounts for the {lost_words}: `dspark bench --profile` shows "
                 "each rank's compute and exposed communication, and flags a straggler")
    if model_state_excess(result):
        cause += (f"; a rank also holds more model state than the {result.strategy} strategy "
                  "needs (see memory_above_expected)")
    return [anomaly("negative_scaling", f"{message}; likely cause: {cause}",
                    speedup=speedup, speedup_min=result.speedup_min,
                    speedup_max=result.speedup_max, step_ms=result.step_ms,
                    baseline_step_ms=baseline.step_ms, num_devices=result.num_devices,
                    lost_ms=lost, causes=[{"kind": c.kind, "ms": c.ms} for c in causes],
                    accounted=bool(causes) and causes[0].ms >= ACCOUNTS_FOR * lost)]
