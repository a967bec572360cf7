"""Every lab run held to its plan: what :mod:`dspark.planner` predicts for an N-device result from its
own 1-device baseline, and the ``off_plan`` anomaly when the run costs more than that.

[Note: a result's plan] The baseline of the same run is a measured step on one device: its
forward, backward and optimizer times (``--profile``'s breakdown; without it the step is split
1 : 2 between forward and backward, as a backward's two matrix products per forward one make it),
and its tensor peak beyond model state. :meth:`dspark.planner.Probe.from_one_step` turns that into a
probe, proportional to the batch; :func:`dspark.planner.row_cost` then prices the result's strategy
on its device count at its local micro-batch, over the bus bandwidth the result measured (gloo
on CPU cores: no overlap, see [Note: collective time]). The plan assumes what a healthy run does:
the batch split N ways. A run whose ranks each received the whole batch (the seed's bug) holds
about N times the plan's activations and computes N times its share, and is flagged here as well
as by the batch rules.

The tolerances are the planner's validated error (docs/plan.md) with room for a shared machine:
the rule is for costs well off the plan, not for noise.
"""

from __future__ import annotations

import functools
from typing import Any

from dspark.bench.analyse.anomalies import anomaly, devices
from dspark.bench.present.formatting import format_mb, format_ms
from dspark.bench.result import BenchResult
from dspark.engine import STRATEGIES
from dspark.models import get_workload
from dspark.planner import Interconnect, ModelShape, Probe, RowCost, model_shape, row_cost

__all__ = ["OFF_PLAN_PEAK_TOLERANCE", "OFF_PLAN_STEP_TOLERANCE", "off_plan", "plan_for_result",
           "predicted_fields"]

OFF_PLAN_PEAK_TOLERANCE = 0.25
"""How far above the plan a peak may be, as a fraction, within its error (see [Note: a result's
plan])."""
OFF_PLAN_STEP_TOLERANCE = 0.50
"""How far above the plan a step may be, as a fraction, within its error and a shared machine's
noise."""
OFF_PLAN_SLACK_BYTES = 2_000_000
"""Absolute slack on the peak: allocator rounding on the tiny CPU presets."""


@functools.lru_cache(maxsize=16)
def _shape(workload: str) -> ModelShape | None:
    try:
        wl = get_workload(workload)
    except ValueError:
        return None  # a synthetic or retired workload: no model to plan
    return model_shape(wl.build_model(device="meta"))


def _baseline_phases(baseline: BenchResult) -> tuple[float, float, float]:
    if baseline.phase_ms_by_rank:
        phases = baseline.phase_ms_by_rank[0]
        return phases["forward_ms"], phases["backward_ms"], phases.get("optimizer_ms", 0.0)
    return baseline.step_ms / 3, 2 * baseline.step_ms / 3, 0.0


def plan_for_result(result: BenchResult, baseline: BenchResult | None) -> RowCost | None:
    """The plan's row for ``result`` (an N-device run) from its 1-device ``baseline`` (see
    [Note: a result's plan]); None where there is nothing to plan from.

    Example::

        plan_for_result(two_devices, one_device).activation_bytes
    """
    if (baseline is None or result.num_devices < 2 or result.strategy not in STRATEGIES
            or baseline.local_batch < 1 or result.global_batch % result.num_devices):
        return None
    shape = _shape(result.workload)
    if shape is None:
        return None
    forward_ms, backward_ms, optimizer_ms = _baseline_phases(baseline)
    base_passes = max(1, baseline.micro_batches)
    base_micro = max(1, baseline.local_batch // base_passes)
    unit_bytes = [sum(shape.trainable[i][1].itemsize * _numel(shape.trainable[i][0]) for i in unit)
                  for unit in shape.units]
    probe = Probe.from_one_step(
        device=baseline.device_model or "cpu", batch=base_micro,
        forward_ms=forward_ms / base_passes, backward_ms=backward_ms / base_passes,
        optimizer_ms=optimizer_ms,
        step_bytes=max(0, baseline.peak_bytes_per_rank - baseline.model_state_bytes_per_rank),
        num_params=len(shape.trainable), unit_bytes=unit_bytes)
    gloo = result.backend in ("gloo", "")
    link = Interconnect(name="measured", bytes_per_s=result.bus_bytes_per_s or 1e9,
                        latency_s=50e-6 if gloo else 5e-6, overlaps_compute=not gloo,
                        source="the bus bandwidth the run measured")
    passes = max(1, result.micro_batches)
    local = result.global_batch // result.num_devices
    return row_cost(shape=shape, probe=probe, strategy=result.strategy, num_ranks=result.num_devices,
                    micro_batch=max(1, local // passes), passes=passes,
                    bucket_mb=float(result.engine_options.get("bucket_mb", 25.0)), link=link)


def _numel(shape: tuple[int, ...]) -> int:
    return functools.reduce(lambda a, b: a * b, shape, 1)


def _peak(row: RowCost) -> int:
    return row.peak_bytes


def _step(row: RowCost) -> float:
    return row.compute_ms + row.comm_exposed_ms + row.optimizer_ms


def predicted_fields(result: BenchResult, baseline: BenchResult | None) -> dict[str, Any]:
    """``predicted_peak_bytes_per_rank`` and ``predicted_step_ms`` for ``result`` (None without a
    plan), to store beside the measured ones."""
    row = plan_for_result(result, baseline)
    return {"predicted_peak_bytes_per_rank": None if row is None else _peak(row),
            "predicted_step_ms": None if row is None else round(_step(row), 3)}


def _worst_part(parts: list[tuple[str, float, float]]) -> tuple[str, float] | None:
    """The part furthest above its plan, as ``(name, ratio)``."""
    ratios = [(name, measured / planned) for name, measured, planned in parts if planned > 0]
    return max(ratios, key=lambda item: item[1]) if ratios else None


def off_plan(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """``off_plan`` when the measured peak or step exceeds the plan's by more than its tolerance,
    naming the part that differs most ("activations <ratio> the plan").

    Example::

        off_plan(replicated_two_devices, one_device)   # [{"kind": "off_plan", ...}]
    """
    row = plan_for_result(result, baseline)
    if row is None:
        return []
    out = []
    peak, step = _peak(row), _step(row)
    where = f"{devices(result.num_devices)} {result.strategy}"
    if result.peak_bytes_per_rank > peak * (1 + OFF_PLAN_PEAK_TOLERANCE) + OFF_PLAN_SLACK_BYTES:
        state = row.params_bytes + row.grads_bytes + row.optimizer_bytes
        part = _worst_part([
            ("model state", result.model_state_bytes_per_rank, state),
            ("activations", result.peak_bytes_per_rank - result.model_state_bytes_per_rank,
             peak - state)])
        named = f"; {part[0]} {part[1]:.1f}x the plan" if part else ""
        out.append(anomaly(
            "off_plan",
            f"{where}: peak {format_mb(result.peak_bytes_per_rank)} per rank against the plan's "
            f"{format_mb(peak)} ({result.peak_bytes_per_rank / peak:.2f}x){named}",
            measured_peak_bytes=result.peak_bytes_per_rank, predicted_peak_bytes=peak,
            part=part[0] if part else None))
    if result.step_ms > step * (1 + OFF_PLAN_STEP_TOLERANCE):
        parts = []
        if result.phase_ms_by_rank:
            phases = max(result.phase_ms_by_rank, key=lambda p: p.get("step_ms", 0.0))
            parts = [("compute", phases.get("forward_ms", 0.0) + phases.get("backward_ms", 0.0),
                      row.compute_ms),
                     ("exposed communication", phases.get("comm_exposed_ms", 0.0), row.comm_exposed_ms),
                     ("optimizer", phases.get("optimizer_ms", 0.0), row.optimizer_ms)]
        part = _worst_part(parts)
        named = f"; {part[0]} {part[1]:.1f}x the plan" if part else ""
        out.append(anomaly(
            "off_plan",
            f"{where}: step {format_ms(result.step_ms)} against the plan's {format_ms(step)} "
            f"({result.step_ms / step:.2f}x){named}",
            measured_step_ms=result.step_ms, predicted_step_ms=step, part=part[0] if part else None))
    return out
