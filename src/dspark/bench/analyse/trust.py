"""The rules about whether a measurement can be trusted at all: a busy machine during the timed
steps, and a 1-device baseline that is unsteady or makes N devices look better than N can be.

Pure functions over :class:`BenchResult`, like :mod:`dspark.bench.analyse.anomalies`.
"""

from __future__ import annotations

from typing import Any

from dspark.bench.analyse.anomalies import anomaly, devices
from dspark.bench.analyse.noise import DEFAULT_RUN_TO_RUN, relative_range
from dspark.bench.present.formatting import format_ms, format_ratio
from dspark.bench.result import BenchResult

__all__ = ["BASELINE_ROUND_SPREAD", "CORE_FOREIGN_ALLOWANCE", "SUPERLINEAR_MARGIN", "busy_machine",
           "suspect_baseline"]

CORE_FOREIGN_ALLOWANCE = 0.10
"""The share of the timed window a rank's core may spend on other processes (or stolen by the
hypervisor) before its times are called untrustworthy (see [Note: load over the timed window] in
:mod:`dspark.bench.measure.cpu_load`)."""


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
"""How far above N a round's speedup may sit before the baseline is suspect: perfect scaling
measured with a few percent of noise straddles N."""
BASELINE_ROUND_SPREAD = 2 * DEFAULT_RUN_TO_RUN
"""How far a 1-device baseline's round medians may range (``(max - min) / min``) within one run:
twice the run-to-run range of same-code reruns (see [Note: noise rule]). Rounds that disagree by
more than that measured a machine that changed under them, and every speedup against them with it."""


def _unsteady(baseline: BenchResult) -> float | None:
    spread = relative_range(baseline.round_step_ms)
    return spread if len(baseline.round_step_ms) > 1 and spread > BASELINE_ROUND_SPREAD else None


def _rounds_ms(result: BenchResult) -> str:
    return " / ".join(format_ms(ms) for ms in result.round_step_ms)


def suspect_baseline(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """The 1-device baseline cannot be trusted: on a 1-device result, its rounds disagree by more
    than :data:`BASELINE_ROUND_SPREAD`; on an N-device result, the same of its baseline, or N
    devices came out more than N times faster than 1 in any round (by more than
    ``SUPERLINEAR_MARGIN``), or in every round. Splitting a batch over N devices can at best divide
    the compute by N, so a slowed baseline is far more likely than a superlinear gain.

    Example::

        suspect_baseline(two_devices, one_device)   # "2 devices are more than ... faster than 1 (round 1: ..."
    """
    if result.num_devices == 1 and result.key == result.baseline_key:
        spread = _unsteady(result)
        if spread is None:
            return []
        return [anomaly("suspect_baseline",
                        f"its {len(result.round_step_ms)} rounds' median steps ({_rounds_ms(result)}) "
                        f"range by {spread:.0%}, beyond the {BASELINE_ROUND_SPREAD:.0%} rounds of one "
                        "run may differ: the machine changed under it, so every speedup measured "
                        "against it is unreliable; re-run on a quiet machine",
                        round_step_ms=list(result.round_step_ms), round_spread=spread,
                        num_devices=1)]
    if baseline is None or result.num_devices <= 1 or result.speedup is None:
        return []
    n = result.num_devices
    low = result.speedup_min if result.speedup_min is not None else result.speedup
    high = result.speedup_max if result.speedup_max is not None else result.speedup
    rounds: list[tuple[int | str, float]] = (
        list(zip(result.round_indices, result.round_speedups, strict=False)) or [("?", high)])
    above = [(index, s) for index, s in rounds if s > n * (1 + SUPERLINEAR_MARGIN)]
    unsteady = _unsteady(baseline)
    if not above and low <= n and unsteady is None:
        return []  # perfect scaling within the rounds' own spread is not evidence of a bad baseline
    facts = [f"the baseline's step was {format_ms(baseline.step_ms)} (result {baseline.result_id})"]
    busiest = max((s for s in baseline.core_foreign_share_by_round if s is not None), default=None)
    if busiest is not None:
        facts.append(f"its core spent up to {busiest:.0%} of a timed window on other processes")
    if baseline.threads_unpinned:
        facts.append(f"{baseline.threads_unpinned} of its threads were not pinned")
    if len(baseline.round_step_ms) > 1:
        facts.append(f"its rounds' medians ({_rounds_ms(baseline)}) ranged by "
                     f"{relative_range(baseline.round_step_ms):.0%}")
    if above or low > n:
        where = (", ".join(f"round {index}: {format_ratio(s)}" if index != "?" else
                           f"a round at {format_ratio(s)}" for index, s in above)
                 if above else f"every round, {format_ratio(low)}-{format_ratio(high)}")
        claim = (f"{devices(n)} are more than {n}x faster than 1 ({where}; median "
                 f"{format_ratio(result.speedup)}), above the {n}x that {devices(n)} can give")
    else:
        claim = (f"the baseline's rounds disagree by more than the {BASELINE_ROUND_SPREAD:.0%} "
                 f"rounds of one run may, so the {format_ratio(result.speedup)} of {devices(n)} "
                 f"(rounds {format_ratio(low)}-{format_ratio(high)}) is not a measurement of scaling")
    message = (f"{claim}: the 1-device baseline is suspect ({'; '.join(facts)}); a slowed "
               "baseline (load, unpinned threads, a cold start) is far more likely than a "
               "superlinear gain from smaller per-rank batches fitting a cache; re-run both on a "
               "quiet machine")
    return [anomaly("suspect_baseline", message, speedup=result.speedup, speedup_min=low,
                    speedup_max=high, rounds_above=[index for index, _ in above if index != "?"],
                    num_devices=n, baseline_result_id=baseline.result_id,
                    baseline_step_ms=baseline.step_ms, baseline_round_spread=relative_range(
                        baseline.round_step_ms))]
