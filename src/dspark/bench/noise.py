"""When is one step time really different from another? The bench lab's one noise rule.

[Note: noise rule]
Two measurements of one configuration differ beyond noise when the median moved by more than
the noise band, ``band = max(10%, spread(a), spread(b))`` where ``spread = (p90 - p10) / median``
of each run's timed steps. So a run whose steps scatter by 12% needs a 12% move before it counts,
and even perfectly steady runs need 10%: between invocations a CPU step moves more than within
one (on this project's shared 2-core box, five back-to-back runs of the same 1-device
resnet50-cpu configuration had medians from 398 to 453 ms, each with a p10-p90 spread under 5%).
The test is symmetric in ratio: B is *slower* when ``B > A * (1 + band)`` and *faster* when
``B < A / (1 + band)``. Regressions (analysis) and ``dspark bench compare`` both use it, so a
report and a comparison never disagree.
"""

from __future__ import annotations

from typing import Literal

from dspark.bench.result import BenchResult

__all__ = ["NOISE_FLOOR", "Verdict", "noise_band", "relative_spread", "timing_verdict"]

NOISE_FLOOR = 0.10
"""The smallest relative change ever called a difference (see [Note: noise rule])."""

Verdict = Literal["faster", "slower", "within noise"]


def relative_spread(result: BenchResult) -> float:
    """``(p90 - p10) / median`` of the result's timed steps (0 when the median is not positive).

    Example::

        relative_spread(result)   # 0.08 for p10=96, median=100, p90=104
    """
    if result.step_ms <= 0:
        return 0.0
    return max(0.0, result.step_ms_p90 - result.step_ms_p10) / result.step_ms


def noise_band(a: BenchResult, b: BenchResult) -> float:
    """The relative change below which ``a`` and ``b`` count as the same speed.

    Example::

        noise_band(old, new)   # 0.10 for two steady runs
    """
    return max(NOISE_FLOOR, relative_spread(a), relative_spread(b))


def timing_verdict(a: BenchResult, b: BenchResult) -> Verdict:
    """How ``b``'s median step time compares with ``a``'s, under [Note: noise rule].

    Example::

        timing_verdict(old, new)   # "slower" when new took 280 ms vs 245 ms, both steady
    """
    if a.step_ms <= 0 or b.step_ms <= 0:
        return "within noise"  # no timing to compare; the caller reports the raw numbers
    band = noise_band(a, b)
    if b.step_ms > a.step_ms * (1 + band):
        return "slower"
    if b.step_ms < a.step_ms / (1 + band):
        return "faster"
    return "within noise"
