"""Scaling analysis: speedup and efficiency against the 1-device run, and the anomaly rules.

Pure functions over :class:`BenchResult` lists; no process group. ``annotate`` is what the runner
calls before results go into the ledger, and what a report may call again on ledger results:
it is idempotent (see [Note: re-annotation]).

[Note: re-annotation]
``annotate`` returns copies and never touches its input. On each copy it drops the anomalies of
the kinds it recomputes and appends fresh ones, so annotating twice does not duplicate them.
``regression`` needs the history; without one, earlier ``regression`` anomalies are kept as they
were. Anomalies of other kinds (e.g. from the runner) are always kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dspark.bench.anomalies import (
    ANOMALY_KINDS,
    below_cost_model,
    memory_above_expected,
    negative_scaling,
    regression,
    replicated_batch,
)
from dspark.bench.cost_model import StepPrediction, cost_model_step_ms, predict_step
from dspark.bench.result import BenchResult, ConfigKey

if TYPE_CHECKING:
    from dspark.bench.ledger import Ledger

__all__ = [
    "ANOMALY_KINDS",
    "StepPrediction",
    "annotate",
    "cost_model_step_ms",
    "efficiency",
    "find_baseline",
    "predict_step",
    "speedup",
]

_BaselineRule = Callable[[BenchResult, BenchResult | None], list[dict[str, Any]]]

# Order = order in reports: the symptom first, then its causes.
_BASELINE_RULES: tuple[_BaselineRule, ...] = (
    negative_scaling, replicated_batch, memory_above_expected, below_cost_model)


def speedup(result: BenchResult, baseline: BenchResult) -> float:
    """How many times faster a step is than the 1-device step (same global batch).

    Example::

        speedup(two_devices, one_device)   # 245 ms / 130 ms = 1.88
    """
    if result.step_ms <= 0:
        raise ValueError(f"step_ms={result.step_ms!r} of {result.key} must be > 0")
    return baseline.step_ms / result.step_ms


def efficiency(speedup_x: float, num_devices: int) -> float:
    """Speedup per device: 1.0 is perfect strong scaling.

    Example::

        efficiency(1.88, 2)   # 0.94
    """
    return speedup_x / num_devices


def find_baseline(result: BenchResult, results: Sequence[BenchResult],
                  history: dict[ConfigKey, BenchResult] | None = None) -> BenchResult | None:
    """The 1-device result ``result`` is measured against: the last one with its
    ``baseline_key`` in ``results``, else the one in ``history`` (latest results by key).

    Example::

        find_baseline(two_devices, results, ledger.latest_by_key())
    """
    for candidate in reversed(results):
        if candidate.key == result.baseline_key:
            return candidate
    return (history or {}).get(result.baseline_key)


def annotate(results: list[BenchResult], *, history: Ledger | None = None) -> list[BenchResult]:
    """Copies of ``results`` with speedup, efficiency and anomalies filled in.

    The baseline of each is the 1-device result of its ``baseline_key`` found in ``results``,
    else ``history``'s latest; baselines themselves get speedup 1.0. With a ``history``, each
    result is also checked for a regression against ``history.previous(result)``. Results without
    a baseline keep ``speedup=None``. See [Note: re-annotation].

    Example::

        with Ledger(path) as ledger:
            ledger.append(annotate(results, history=ledger))
    """
    latest = history.latest_by_key() if history is not None else None
    recomputed = set(ANOMALY_KINDS) if history is not None else set(ANOMALY_KINDS) - {"regression"}
    annotated = []
    for result in results:
        baseline = find_baseline(result, results, latest)
        scaling: dict[str, Any] = {"speedup": None, "efficiency": None}
        if result.key == result.baseline_key:
            scaling = {"speedup": 1.0, "efficiency": 1.0}
        elif baseline is not None and result.step_ms > 0:
            factor = speedup(result, baseline)
            scaling = {"speedup": factor, "efficiency": efficiency(factor, result.num_devices)}
        anomalies = [dict(a) for a in result.anomalies if a.get("kind") not in recomputed]
        for rule in _BASELINE_RULES:
            anomalies += rule(result, baseline)
        if history is not None:
            anomalies += regression(result, history.previous(result))
        annotated.append(dataclasses.replace(result, anomalies=anomalies,
                                             replicated_inputs=list(result.replicated_inputs),
                                             **scaling))
    return annotated
