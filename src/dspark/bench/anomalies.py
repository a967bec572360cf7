"""The anomaly rules: each looks at one result (and its 1-device baseline or its previous run)
and says, in plain words with the numbers, what is wrong and the likely cause.

Every rule is a pure function returning anomaly dicts ``{"kind", "message", <numbers>...}``
(empty when healthy), so each is tested on synthetic results with no process group. The
thresholds below are deliberately loose: a false alarm on every run teaches people to ignore
the report, which is how the seed's bug hid.

[Note: activation bytes]
Activation bytes per rank = ``peak_bytes_per_rank - model_state_bytes_per_rank``: what the rank
held at its peak beyond parameters, gradients and optimizer state. With the batch split N ways,
each rank should need about 1/N of the 1-device run's activation bytes.
"""

from __future__ import annotations

from typing import Any

from dspark.bench.cost_model import predict_step
from dspark.bench.formatting import format_mb, format_ms, format_ratio
from dspark.bench.noise import noise_band, timing_verdict
from dspark.bench.result import BenchResult

__all__ = [
    "ACTIVATION_TOLERANCE",
    "ANOMALY_KINDS",
    "COST_MODEL_MIN_EFFICIENCY",
    "COST_MODEL_SLOWDOWN",
    "MEMORY_SLACK_BYTES",
    "MODEL_STATE_TOLERANCE",
    "activation_bytes_per_rank",
    "below_cost_model",
    "is_batch_replicated",
    "memory_above_expected",
    "negative_scaling",
    "regression",
    "replicated_batch",
]

ANOMALY_KINDS = ("negative_scaling", "replicated_batch", "memory_above_expected",
                 "below_cost_model", "regression")

MODEL_STATE_TOLERANCE = 0.05
"""Model state may exceed the strategy's formula by 5% (uneven shards are padded)."""
ACTIVATION_TOLERANCE = 1.5
"""Activations may reach 1.5x a 1/N share (per-rank fixed buffers do not shrink with the batch)."""
MEMORY_SLACK_BYTES = 1_000_000
"""Absolute slack on both memory rules, so tiny CPU presets are not flagged for allocator noise."""
COST_MODEL_SLOWDOWN = 1.35
"""A step this many times the cost model's prediction is suspicious ..."""
COST_MODEL_MIN_EFFICIENCY = 0.8
"""... when the scaling efficiency is also below this (a fast run slower than a model is fine)."""


def _anomaly(kind: str, message: str, **numbers: Any) -> dict[str, Any]:
    return {"kind": kind, "message": message, **numbers}


def _devices(num_devices: int) -> str:
    return f"{num_devices} device" + ("" if num_devices == 1 else "s")


def activation_bytes_per_rank(result: BenchResult) -> int:
    """Peak bytes beyond the model state (see [Note: activation bytes]).

    Example::

        activation_bytes_per_rank(result)   # peak 80 MB - model state 30 MB = 50_000_000
    """
    return max(0, result.peak_bytes_per_rank - result.model_state_bytes_per_rank)


def is_batch_replicated(result: BenchResult) -> bool:
    """True when ranks processed more than their share of the batch, or held batch tensors whole.

    Example::

        is_batch_replicated(result)   # True for local_batch=256, global_batch=256 on 2 devices
    """
    if result.num_devices <= 1:
        return False
    return (result.local_batch * result.num_devices > result.global_batch
            or bool(result.replicated_inputs))


def _expected_activation_bytes(result: BenchResult, baseline: BenchResult | None) -> float | None:
    if baseline is None or activation_bytes_per_rank(baseline) <= 0:
        return None
    return activation_bytes_per_rank(baseline) / result.num_devices


def _model_state_excess(result: BenchResult) -> bool:
    expected = result.model_state_bytes_expected_per_rank
    return expected > 0 and result.model_state_bytes_per_rank > (
        expected * (1 + MODEL_STATE_TOLERANCE) + MEMORY_SLACK_BYTES)


def _replication_cause(result: BenchResult) -> str:
    if result.batch_placement == "replicate":
        return ("shard_dim=REPLICATE, chosen on purpose by batch_placement='replicate' to "
                "reproduce the seed's bug")
    return "shard_dim=REPLICATE or None upstream"


def negative_scaling(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """N devices took longer per step than 1 device on the same global batch.

    Flagged whenever the speedup is below 1: N devices no faster than one is an anomaly even
    when the gap is within noise (the message then says so). Example::

        negative_scaling(two_devices, one_device)   # "2 devices are 1.14x slower than 1 (...)"
    """
    if result.num_devices <= 1 or baseline is None or result.step_ms <= 0 or baseline.step_ms <= 0:
        return []
    speedup = baseline.step_ms / result.step_ms
    if speedup >= 1:
        return []
    message = (f"{_devices(result.num_devices)} are {format_ratio(1 / speedup)} slower than 1 "
               f"({format_ms(result.step_ms)} vs {format_ms(baseline.step_ms)})")
    if timing_verdict(baseline, result) == "within noise":
        message += (f", within the noise band of {noise_band(baseline, result):.0%}: at best no "
                    "faster than 1")
    if is_batch_replicated(result):
        cause = ("the batch is replicated on every rank, not split, so each rank does the whole "
                 "step's compute and then communicates on top")
    elif _model_state_excess(result):
        cause = (f"model state is replicated where the {result.strategy} strategy shards it, "
                 "adding memory traffic and copies")
    elif result.comm_wire_bytes_per_step and result.bus_bytes_per_s > 0:
        comm_ms = result.comm_wire_bytes_per_step / result.bus_bytes_per_s * 1e3
        cause = (f"communication ({format_ms(comm_ms)} per step for "
                 f"{format_mb(result.comm_wire_bytes_per_step)} on the wire) outweighs the "
                 "compute saved, or ranks wait on each other")
    else:
        cause = "not evident from the numbers: profile communication and rank stragglers"
    return [_anomaly("negative_scaling", f"{message}; likely cause: {cause}",
                     speedup=speedup, step_ms=result.step_ms, baseline_step_ms=baseline.step_ms,
                     num_devices=result.num_devices)]


def replicated_batch(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """Batch tensors are whole on every rank instead of split (the seed's bug).

    Example::

        replicated_batch(two_devices, one_device)
        # "each rank holds 2.0x the activation memory a sharded batch needs: ..."
    """
    if not is_batch_replicated(result):
        return []
    num_devices = result.num_devices
    tensors = ", ".join(result.replicated_inputs) or "every batch tensor"
    share = result.global_batch / num_devices
    parts = [f"each rank processed {result.local_batch} samples of a global batch of "
             f"{result.global_batch} ({result.local_batch / share:.1f}x its 1/{num_devices} "
             f"share of {share:g})"]
    numbers: dict[str, Any] = {"local_batch": result.local_batch,
                               "global_batch": result.global_batch,
                               "num_devices": num_devices,
                               "replicated_inputs": list(result.replicated_inputs)}
    expected = _expected_activation_bytes(result, baseline)
    if expected is not None:
        held = activation_bytes_per_rank(result)
        ratio = held / expected
        parts.append(f"each rank holds {ratio:.1f}x the activation memory a sharded batch needs "
                     f"({format_mb(held)} vs {format_mb(expected)})")
        numbers.update(activation_bytes_per_rank=held,
                       expected_activation_bytes_per_rank=expected, activation_ratio=ratio)
    message = (f"{'; '.join(parts)}: the batch ({tensors}) is replicated on every rank, not "
               f"split ({_replication_cause(result)})")
    return [_anomaly("replicated_batch", message, **numbers)]


_PART_NAMES = {"params": "the parameters", "grads": "the gradients",
               "optimizer": "the optimizer state"}


def _excess_parts(result: BenchResult) -> str:
    """Which model-state tensors exceed the formula, e.g. "the gradients (59.5 MB held, 29.7 MB
    needed) are replicated where they should be sharded"."""
    over = [f"{_PART_NAMES.get(part, part)} ({format_mb(held)} held, {format_mb(need)} needed)"
            for part, (held, need) in result.model_state_parts.items()
            if held > need * (1 + MODEL_STATE_TOLERANCE) + MEMORY_SLACK_BYTES / 3]
    if not over:
        return "a tensor is replicated where it should be sharded"
    return " and ".join(over) + " held whole where the strategy shards them"


def memory_above_expected(result: BenchResult,
                          baseline: BenchResult | None) -> list[dict[str, Any]]:
    """A rank holds more than its strategy needs: (a) model state above the ZeRO formula, or
    (b) activations above 1.5x a 1/N share of the 1-device run's although the batch is sharded.

    Example::

        memory_above_expected(zero2_run, one_device)
        # "rank holds 51.2 MB of model state, the zero2 strategy needs 25.6 MB: ..."
    """
    found = []
    expected_state = result.model_state_bytes_expected_per_rank
    if _model_state_excess(result):
        held = result.model_state_bytes_per_rank
        found.append(_anomaly(
            "memory_above_expected",
            f"rank holds {format_mb(held)} of model state, the {result.strategy} strategy needs "
            f"{format_mb(expected_state)} ({held / expected_state:.2f}x): {_excess_parts(result)}",
            memory="model_state", model_state_bytes_per_rank=held,
            model_state_bytes_expected_per_rank=expected_state, ratio=held / expected_state))
    expected_activation = _expected_activation_bytes(result, baseline)
    if (result.num_devices > 1 and expected_activation is not None
            and not is_batch_replicated(result)):  # a replicated batch has its own rule
        held = activation_bytes_per_rank(result)
        if held > expected_activation * ACTIVATION_TOLERANCE + MEMORY_SLACK_BYTES:
            found.append(_anomaly(
                "memory_above_expected",
                f"each rank holds {format_mb(held)} of activations, {held / expected_activation:.1f}x "
                f"the {format_mb(expected_activation)} a 1/{result.num_devices} share of the "
                "1-device run needs, although the batch is sharded: an activation or buffer is "
                "likely replicated, or kept alive across steps",
                memory="activations", activation_bytes_per_rank=held,
                expected_activation_bytes_per_rank=expected_activation,
                ratio=held / expected_activation))
    return found


def below_cost_model(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """The measured speedup is far below what compute share + communication predict.

    Skipped when no bus bandwidth was measured (``bus_bytes_per_s == 0``). Example::

        below_cost_model(two_devices, one_device)
        # "2 devices reach 1.10x (efficiency 55%), the cost model predicts 1.85x (...)"
    """
    if (result.num_devices <= 1 or baseline is None or result.bus_bytes_per_s <= 0
            or result.step_ms <= 0 or baseline.step_ms <= 0):
        return []
    predicted = predict_step(baseline_step_ms=baseline.step_ms, local_batch=result.local_batch,
                             global_batch=result.global_batch,
                             comm_wire_bytes_per_step=result.comm_wire_bytes_per_step,
                             bus_bytes_per_s=result.bus_bytes_per_s)
    speedup = baseline.step_ms / result.step_ms
    efficiency = speedup / result.num_devices
    slowdown = result.step_ms / predicted.step_ms
    if slowdown <= COST_MODEL_SLOWDOWN or efficiency >= COST_MODEL_MIN_EFFICIENCY:
        return []
    predicted_speedup = baseline.step_ms / predicted.step_ms
    predicted_efficiency = predicted_speedup / result.num_devices
    comm_share = predicted.comm_ms / predicted.step_ms
    message = (
        f"{_devices(result.num_devices)} reach {format_ratio(speedup)} (efficiency "
        f"{efficiency:.0%}), the cost model predicts {format_ratio(predicted_speedup)} "
        f"({predicted_efficiency:.0%}): measured {format_ms(result.step_ms)} vs predicted "
        f"{format_ms(predicted.step_ms)} = {format_ms(predicted.compute_ms)} compute "
        f"({result.local_batch}/{result.global_batch} of the {format_ms(baseline.step_ms)} "
        f"1-device step) + {format_ms(predicted.comm_ms)} communication "
        f"({format_mb(result.comm_wire_bytes_per_step)} on the wire at "
        f"{result.bus_bytes_per_s / 1e9:.2f} GB/s; {comm_share:.0%} of the prediction); the "
        f"step takes {format_ratio(slowdown)} the prediction, spent on what the model does not "
        "count: stragglers, oversubscribed cores, extra copies or synchronisation")
    return [_anomaly("below_cost_model", message, speedup=speedup, efficiency=efficiency,
                     predicted_speedup=predicted_speedup, predicted_step_ms=predicted.step_ms,
                     predicted_compute_ms=predicted.compute_ms,
                     predicted_comm_ms=predicted.comm_ms, step_ms=result.step_ms)]


_PROVENANCE = (("git_commit", "commit"), ("git_dirty", "uncommitted changes"),
               ("dspark_version", "DSpark"), ("torch_version", "PyTorch"),
               ("python_version", "Python"), ("host", "host"), ("device_model", "device"),
               ("backend", "backend"))


def _shown(name: str, result: BenchResult) -> object:
    value = getattr(result, name)
    return value[:12] if name == "git_commit" else value  # git's own abbreviation length


def regression(result: BenchResult, previous: BenchResult | None) -> list[dict[str, Any]]:
    """Slower than the previous result of the same configuration, beyond noise
    (see [Note: noise rule] in :mod:`dspark.bench.noise`). Improvements are not anomalies.

    Example::

        regression(new, ledger.previous(new))   # "step time rose 14.3% since run ... "
    """
    if previous is None or timing_verdict(previous, result) != "slower":
        return []
    rise = result.step_ms / previous.step_ms - 1
    band = noise_band(previous, result)
    changed = [f"{label} {_shown(name, previous)!r} -> {_shown(name, result)!r}"
               for name, label in _PROVENANCE if getattr(previous, name) != getattr(result, name)]
    cause = ("what changed: " + "; ".join(changed) if changed else
             "nothing recorded changed (same commit, versions and host): likely load on the "
             "machine; re-run to confirm")
    message = (f"step time rose {rise:.1%} since run {previous.run_id} "
               f"({format_ms(result.step_ms)} vs {format_ms(previous.step_ms)}), beyond the "
               f"noise band of {band:.1%}; {cause}")
    return [_anomaly("regression", message, step_ms=result.step_ms,
                     previous_step_ms=previous.step_ms, previous_run_id=previous.run_id,
                     previous_git_commit=previous.git_commit, relative_change=rise,
                     noise_band=band)]
