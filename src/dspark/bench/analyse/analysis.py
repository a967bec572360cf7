"""Scaling analysis: speedup and efficiency against the 1-device result of the same run, and the
anomaly rules. Computed whenever results are read, never stored (see :mod:`dspark.bench.ledger.ledger`).

[Note: speedup from rounds]
A run measures each configuration in rounds that alternate with its 1-device baseline (see
[Note: rounds] in :mod:`dspark.bench.ledger.measurement`). Round ``r``'s speedup is the baseline's median
step in round ``r`` over this configuration's median step in round ``r``; the result's speedup is
the median of those ratios, reported with their min and max. The baseline is always the 1-device
result of the *same run* (named by ``baseline_result_id``): a result whose run has no baseline has
no speedup, rather than one against a day-old measurement from another commit or host.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dspark.bench.analyse.anomalies import memory_above_expected, regression, replicated_batch
from dspark.bench.analyse.breakdown import straggler
from dspark.bench.analyse.causes import negative_scaling
from dspark.bench.analyse.noise import NoiseModel
from dspark.bench.analyse.off_plan import off_plan, predicted_fields
from dspark.bench.analyse.samples import missing_samples
from dspark.bench.analyse.trust import busy_machine, suspect_baseline
from dspark.bench.result import BenchResult

if TYPE_CHECKING:
    from dspark.bench.ledger.ledger import Ledger

__all__ = [
    "Scaling",
    "annotate",
    "find_baseline",
    "scaling",
]

_Rule = Callable[[BenchResult, BenchResult | None], list[dict[str, Any]]]

# Order = order in reports: the symptom first, then its causes, then what may void the figures
# (annotate() puts straggler, which needs the noise model, between the two groups).
_BASELINE_RULES: tuple[_Rule, ...] = (
    negative_scaling, suspect_baseline, replicated_batch, missing_samples, memory_above_expected,
    off_plan)
_TRUST_RULES: tuple[_Rule, ...] = (busy_machine,)

@dataclass(frozen=True, kw_only=True, slots=True)
class Scaling:
    """A result's speedup over its baseline (see [Note: speedup from rounds])."""

    round_speedups: tuple[float, ...]
    """One ratio per round both measured, in round order."""

    @property
    def speedup(self) -> float:
        return statistics.median(self.round_speedups)

    @property
    def low(self) -> float:
        return min(self.round_speedups)

    @property
    def high(self) -> float:
        return max(self.round_speedups)


def scaling(result: BenchResult, baseline: BenchResult) -> Scaling | None:
    """The per-round speedups of ``result`` over ``baseline``, paired by round index, each scaled
    by the samples a step of each trained (the probe's count); None when they share no round with
    a positive median.

    Example::

        scaling(two_devices, one_device).speedup   # median of (245/130, 250/128, 240/131)
    """
    mine = dict(zip(result.round_indices, result.round_step_ms, strict=False))
    theirs = dict(zip(baseline.round_indices, baseline.round_step_ms, strict=False))
    # per sample, by the probe's count (see [Note: samples counted] in dspark.bench.analyse.samples)
    work = (result.samples_per_step / baseline.samples_per_step
            if result.samples_per_step > 0 and baseline.samples_per_step > 0 else 1.0)
    ratios = tuple(theirs[r] / mine[r] * work for r in sorted(mine.keys() & theirs.keys())
                   if mine[r] > 0 and theirs[r] > 0)
    return Scaling(round_speedups=ratios) if ratios else None


def find_baseline(result: BenchResult, results: Sequence[BenchResult]) -> BenchResult | None:
    """The 1-device result ``result`` is measured against: the one with its ``baseline_key`` in
    the same run, in ``results``; None when the run has none.

    Example::

        find_baseline(two_devices, ledger.results(run_id=two_devices.run_id))
    """
    for candidate in reversed(results):
        if candidate.key == result.baseline_key and candidate.run_id == result.run_id:
            return candidate
    return None


def annotate(results: list[BenchResult], *, history: Ledger | None = None) -> list[BenchResult]:
    """Copies of ``results`` with speedup, efficiency and anomalies computed now.

    The baseline of each is the 1-device result of its ``baseline_key`` from the same run, in
    ``results``; baselines themselves get speedup 1.0, results without one ``speedup=None``. With
    a ``history`` (the ledger), each result is also checked for a regression against
    ``history.previous(result)``, with noise bands from the history; a profiled result's ranks are
    checked for a straggler against the host's run-to-run range from the same history (see
    :mod:`dspark.bench.analyse.breakdown`). Any anomalies a result came
    with are replaced: the rules are the truth, not what an older version wrote down.

    Example::

        with Ledger(path) as ledger:
            annotated = annotate(ledger.results(run_id=run_id), history=ledger)
    """
    noise = NoiseModel.from_history(history.results()) if history is not None else None
    annotated = []
    for result in results:
        fields: dict[str, Any] = {"speedup": None, "speedup_min": None, "speedup_max": None,
                                  "round_speedups": [], "efficiency": None,
                                  "baseline_result_id": None}
        baseline = None
        if result.key == result.baseline_key:
            fields.update(speedup=1.0, speedup_min=1.0, speedup_max=1.0, efficiency=1.0,
                          baseline_result_id=result.result_id)
        else:
            baseline = find_baseline(result, results)
            found = scaling(result, baseline) if baseline is not None else None
            if baseline is not None and found is not None:
                fields.update(speedup=found.speedup, speedup_min=found.low,
                              speedup_max=found.high, round_speedups=list(found.round_speedups),
                              efficiency=found.speedup / result.num_devices,
                              baseline_result_id=baseline.result_id)
            else:
                baseline = None
        fields.update(predicted_fields(result, baseline))
        scaled = dataclasses.replace(result, anomalies=[], **fields)
        anomalies: list[dict[str, Any]] = []
        for rule in _BASELINE_RULES:
            anomalies += rule(scaled, baseline)
        anomalies += straggler(scaled, noise)
        for rule in _TRUST_RULES:
            anomalies += rule(scaled, baseline)
        if history is not None:
            anomalies += regression(scaled, history.previous(scaled), noise)
        annotated.append(dataclasses.replace(scaled, anomalies=anomalies))
    return annotated
