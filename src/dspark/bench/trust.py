"""The rules about whether a measurement can be trusted at all: a busy machine during the timed
steps, and a 1-device baseline that makes N devices look better than N devices can be.

Pure functions over :class:`BenchResult`, like :mod:`dspark.bench.anomalies`.
"""

from __future__ import annotations

from typing import Any

from dspark.bench.anomalies import anomaly, devices
from dspark.bench.formatting import format_ms, format_ratio
from dspark.bench.noise import relative_range
from dspark.bench.result import BenchResult

__all__ = ["CORE_FOREIGN_ALLOWANCE", "SUPERLINEAR_MARGIN", "busy_machine", "suspect_baseline"]

CORE_FOREIGN_ALLOWANCE = 0.10
"""A rank's core may spend 10% of the timed window on other processes (or stolen by the
hypervisor) before its times are called untrustworthy (see [Note: load over the timed window] in
:mod:`dspark.bench.cpu_load`)."""


def _busy_rounds(result: BenchResult) -> list[tuple[int, float]]:
    return [(index, share) for index, share in zip(
        result.round_indices or range(len(result.core_foreign_share_by_round)),
        result.core_foreign_share_by_round, strict=False)
        if share is not None and share > CORE_FOREIGN_ALLOWANCE]


def busy_machine(result: BenchResult, baseline: BenchResult | None = None) -> list[dict[str, Any]]:
    """Other processes ran on a rank's core during its timed steps, in some round, for more than
    :data:`CORE_FOREIGN_ALLOWANCE` of the window; or a rank's threads were not all on its core.

    Example::

        busy_machine(result)   # [{"kind": "busy_machine", "message": "in round 1, a rank's core ..."}]
    """
    busy = _busy_rounds(result)
    if not busy and result.threads_unpinned == 0:
        return []
    facts = []
    if busy:
        worst = max(share for _, share in busy)
        rounds = ", ".join(str(index) for index, _ in busy)
        facts.append(f"in round{'s' if len(busy) > 1 else ''} {rounds} of {result.rounds}, a rank's "
                     f"core spent up to {worst:.0%} of its timed window on other processes or "
                     f"stolen time (more than the {CORE_FOREIGN_ALLOWANCE:.0%} allowed; the rank's "
                     "own threads are not counted)")
    if result.threads_unpinned:
        facts.append(f"{result.threads_unpinned} thread(s) of a rank were not pinned to its core")
    message = (f"{'; '.join(facts)}: other work took time from the ranks, so these step times "
               "are not trustworthy; re-run on a quiet machine")
    return [anomaly("busy_machine", message,
                    foreign_share_by_round=list(result.core_foreign_share_by_round),
                    busy_rounds=[index for index, _ in busy],
                    threads_unpinned=result.threads_unpinned)]


SUPERLINEAR_MARGIN = 0.03
"""How far above N a median speedup may sit, while some round is at or below N, before the baseline
is suspect: perfect scaling measured with a few percent of noise straddles N."""


def suspect_baseline(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """N devices came out more than N times faster than 1: every round above N, or the median more
    than ``SUPERLINEAR_MARGIN`` above it. The 1-device baseline was then likely slowed down, since
    splitting a batch over N devices can at best divide the compute by N.

    Example::

        suspect_baseline(two_devices, one_device)   # "2 devices are 2.31x faster than 1, above ..."
    """
    if baseline is None or result.num_devices <= 1 or result.speedup is None:
        return []
    n = result.num_devices
    low = result.speedup_min if result.speedup_min is not None else result.speedup
    if result.speedup <= n or (low <= n and result.speedup <= n * (1 + SUPERLINEAR_MARGIN)):
        return []  # perfect scaling within the rounds' own spread is not evidence of a bad baseline
    facts = [f"the baseline's step was {format_ms(baseline.step_ms)} (result {baseline.result_id})"]
    busiest = max((s for s in baseline.core_foreign_share_by_round if s is not None), default=None)
    if busiest is not None:
        facts.append(f"its core spent up to {busiest:.0%} of a timed window on other processes")
    if baseline.threads_unpinned:
        facts.append(f"{baseline.threads_unpinned} of its threads were not pinned")
    spread = relative_range(baseline.round_step_ms)
    if len(baseline.round_step_ms) > 1:
        facts.append(f"its rounds' medians ranged by {spread:.0%}")
    high = result.speedup_max if result.speedup_max is not None else result.speedup
    message = (f"{devices(result.num_devices)} are {format_ratio(result.speedup)} faster than 1 "
               f"(rounds {format_ratio(low)}-{format_ratio(high)}), above the "
               f"{result.num_devices}x that {devices(result.num_devices)} can give: the 1-device "
               f"baseline is suspect ({'; '.join(facts)}); a slowed baseline (load, unpinned "
               "threads, a cold start) is far more likely than a superlinear gain from smaller "
               "per-rank batches fitting a cache; re-run both on a quiet machine")
    return [anomaly("suspect_baseline", message, speedup=result.speedup, speedup_min=low,
                    speedup_max=high, num_devices=result.num_devices,
                    baseline_result_id=baseline.result_id, baseline_step_ms=baseline.step_ms)]
