"""How the bench lab writes numbers for people: milliseconds, megabytes, ratios, result rows.

One place, so that an anomaly message, the terminal table and the HTML report print the same
figure the same way (``280 ms`` in a message and ``280.0`` in a table would look like two runs).
"""

from __future__ import annotations

from dspark.bench.result import BenchResult

__all__ = ["BYTES_PER_MB", "MEMORY_COLUMNS_NOTE", "RESULT_COLUMNS", "TEXT_COLUMNS", "anomaly_kinds",
           "format_mb", "format_ms", "format_number", "format_ratio", "format_speedup",
           "result_cells"]

BYTES_PER_MB = 1_000_000
"""Decimal megabytes, as the reports label them (``MB``)."""


def format_ms(step_ms: float) -> str:
    """A duration in ms with about three significant digits.

    Example::

        format_ms(280.0)   # "280 ms"
        format_ms(2.456)   # "2.46 ms"
    """
    return f"{format_number(step_ms)} ms"


def format_number(value: float) -> str:
    """About three significant digits without an exponent (``280``, ``24.5``, ``2.46``)."""
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_mb(num_bytes: float) -> str:
    """Bytes as decimal megabytes.

    Example::

        format_mb(25_000_000)  # "25.0 MB"
    """
    return f"{num_bytes / BYTES_PER_MB:.1f} MB"


def format_ratio(ratio: float) -> str:
    """A speedup or slowdown factor (``1.14x``)."""
    return f"{ratio:.2f}x"


def format_speedup(result: BenchResult) -> str:
    """The speedup with the min-max of its rounds, ``-`` when there is none.

    Example::

        format_speedup(result)   # "1.88x (1.80-1.95)"
    """
    if result.speedup is None:
        return "-"
    text = format_ratio(result.speedup)
    if (len(result.round_speedups) > 1 and result.speedup_min is not None
            and result.speedup_max is not None):
        text += f" ({result.speedup_min:.2f}-{result.speedup_max:.2f})"
    return text


RESULT_COLUMNS = ("workload", "devices", "strategy", "precision", "batch", "rounds",
                  "step ms (p10-p90)", "samples/s", "tensor peak MB/rank", "RSS peak MB/rank",
                  "model-state MB/rank", "speedup (rounds min-max)", "efficiency", "anomalies")
"""The columns of a results table, terminal and HTML alike."""
MEMORY_COLUMNS_NOTE = (
    "tensor peak: on CPU, the tensor storages a rank held at its peak during one training step "
    "(those Python reaches plus the allocations PyTorch's profiler saw; not buffers only C++ "
    "holds, such as DDP's reducer buckets); on GPU, the allocator's peak. RSS peak: the rank's "
    "whole process at its peak over the warm-up and timed steps, PyTorch's libraries and every "
    "C++ buffer included. model state: parameters, gradients and optimizer state found by "
    "walking the module and the optimizer.")
"""What the memory columns cover, printed under every results table."""
TEXT_COLUMNS = frozenset({"workload", "strategy", "precision", "batch", "anomalies"})
"""Columns aligned left; the rest are numbers, aligned right."""


def anomaly_kinds(result: BenchResult) -> list[str]:
    """The result's anomaly kinds, each once, in order."""
    return list(dict.fromkeys(str(a.get("kind", "?")) for a in result.anomalies))


def result_cells(result: BenchResult) -> list[str]:
    """One result as the text of :data:`RESULT_COLUMNS` (anomaly kinds comma-separated).

    Example::

        dict(zip(RESULT_COLUMNS, result_cells(result)))["step ms (p10-p90)"]  # "280 (274-286)"
    """
    r = result
    return [r.workload, str(r.num_devices), r.strategy, r.precision,
            f"{r.batch_placement} {r.global_batch}", str(r.rounds),
            f"{format_number(r.step_ms)} ({format_number(r.step_ms_p10)}-"
            f"{format_number(r.step_ms_p90)})",
            format_number(r.samples_per_s),
            f"{r.peak_bytes_per_rank / BYTES_PER_MB:.1f}",
            f"{r.peak_rss_bytes_per_rank / BYTES_PER_MB:.1f}" if r.peak_rss_bytes_per_rank else "-",
            f"{r.model_state_bytes_per_rank / BYTES_PER_MB:.1f}",
            format_speedup(r),
            "-" if r.efficiency is None else f"{r.efficiency:.0%}",
            ", ".join(anomaly_kinds(r)) or "-"]
