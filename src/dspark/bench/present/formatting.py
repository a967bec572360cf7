"""How the bench lab writes numbers for people: milliseconds, megabytes, ratios, result rows.

One place, so that an anomaly message, the terminal table and the HTML report print the same
figure the same way (a figure with a unit in a message and another rounding in a table would look
like two runs).
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark.bench.analyse.peer_ratios import peer_ratios
from dspark.bench.faults import describe_injected
from dspark.bench.result import BenchResult

__all__ = ["BREAKDOWN_COLUMNS", "BREAKDOWN_NOTE", "BYTES_PER_MB", "MEMORY_COLUMNS_NOTE",
           "PEER_COLUMNS", "PEER_NOTE", "PEER_TEXT_COLUMNS", "RESULT_COLUMNS", "TEXT_COLUMNS", "anomaly_kinds",
           "batch_label", "breakdown_rows", "config_label",
           "format_mb", "format_ms", "format_number", "format_ratio", "format_speedup",
           "peer_rows", "result_cells"]

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
    """A speedup or slowdown factor: two decimals and an ``x``."""
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
    "whole process at its peak over the timed steps, PyTorch's libraries and every "
    "C++ buffer included. model state: parameters, gradients and optimizer state found by "
    "walking the module and the optimizer.")
"""What the memory columns cover, printed under every results table."""
TEXT_COLUMNS = frozenset({"workload", "strategy", "precision", "batch", "anomalies"})
"""Columns aligned left; the rest are numbers, aligned right."""


def anomaly_kinds(result: BenchResult) -> list[str]:
    """The result's anomaly kinds, each once, in order, then its injected faults (see [Note:
    injected faults] in :mod:`dspark.bench.faults`): every table that lists anomalies shows them."""
    kinds = list(dict.fromkeys(str(a.get("kind", "?")) for a in result.anomalies))
    return kinds + ([describe_injected(result)] if result.injected_faults else [])


def result_cells(result: BenchResult) -> list[str]:
    """One result as the text of :data:`RESULT_COLUMNS` (anomaly kinds comma-separated).

    Example::

        dict(zip(RESULT_COLUMNS, result_cells(result)))["step ms (p10-p90)"]  # "280 (274-286)"
    """
    r = result
    return [r.workload, str(r.num_devices), r.strategy, r.precision, batch_label(r), str(r.rounds),
            f"{format_number(r.step_ms)} ({format_number(r.step_ms_p10)}-"
            f"{format_number(r.step_ms_p90)})",
            format_number(r.samples_per_s),
            f"{r.peak_bytes_per_rank / BYTES_PER_MB:.1f}",
            f"{r.peak_rss_bytes_per_rank / BYTES_PER_MB:.1f}" if r.peak_rss_bytes_per_rank else "-",
            f"{r.model_state_bytes_per_rank / BYTES_PER_MB:.1f}",
            format_speedup(r),
            "-" if r.efficiency is None else f"{r.efficiency:.0%}",
            ", ".join(anomaly_kinds(r)) or "-"]


BREAKDOWN_PHASES = (("step_ms", "step"), ("forward_ms", "forward"), ("backward_ms", "backward"),
                    ("comm_exposed_ms", "comm exposed"), ("optimizer_ms", "optimizer"),
                    ("data_ms", "data"), ("compute_ms", "compute"))
BREAKDOWN_COLUMNS = ("configuration", "rank", "host", *(f"{label} ms" for _, label in BREAKDOWN_PHASES))
"""The columns of a step-breakdown table (``dspark bench --profile``), terminal and HTML alike."""
BREAKDOWN_NOTE = (
    "step breakdown: each rank's engine.step_stats(), the median over every timed step of every "
    "round, in ms. compute = forward + backward + optimizer without the waits (compare it across "
    "ranks to find a straggler); comm exposed = waiting on communication that compute did not "
    "hide; data = from the previous step() to this forward, which in the lab holds making the "
    "batch and the barrier each timed step starts with. PyTorch's peers have no step breakdown.")
"""What the breakdown columns cover, printed under every breakdown table."""


def batch_label(result: BenchResult) -> str:
    """How a result's batch was placed and run: ``"shard 256"``, or with micro-batches
    ``"shard 256 (8 x 32)"``: each rank's share in 8 passes of 32 samples.

    Example::

        batch_label(result)   # "shard 32"
    """
    label = f"{result.batch_placement} {result.global_batch}"
    if result.micro_batches > 1:
        share = (result.global_batch if result.batch_placement == "replicate"
                 else result.global_batch // result.num_devices)
        label += f" ({result.micro_batches} x {share // result.micro_batches})"
    return label


def config_label(result: BenchResult) -> str:
    """One line naming a result's configuration.

    Example::

        config_label(result)   # "gpt2-cpu, 2 dev, replicate, bf16, batch shard 32"
    """
    injected = f" [{describe_injected(result)}]" if result.injected_faults else ""
    return (f"{result.workload}, {result.num_devices} dev, {result.strategy}, {result.precision}, "
            f"batch {batch_label(result)}{injected}")


def breakdown_rows(result: BenchResult) -> list[list[str]]:
    """The step breakdown of a profiled result as text rows of :data:`BREAKDOWN_COLUMNS`, one per
    rank; one row of dashes when the run had none (a PyTorch peer); [] when not profiled.

    Example::

        breakdown_rows(result)[1][:4]   # ["gpt2-cpu, 2 dev, ...", "1", "box", "131"]
    """
    if not result.profiled:
        return []
    if not result.phase_ms_by_rank:
        return [[config_label(result), "-", ", ".join(dict.fromkeys(result.hosts_by_rank)) or "-",
                 *("-" for _ in BREAKDOWN_PHASES)]]
    hosts = result.hosts_by_rank
    return [[config_label(result), str(rank), hosts[rank] if rank < len(hosts) else "-",
             *(format_number(phases[key]) if key in phases else "-" for key, _ in BREAKDOWN_PHASES)]
            for rank, phases in enumerate(result.phase_ms_by_rank)]


PEER_COLUMNS = ("workload", "devices", "precision", "batch", "DSpark", "peer", "DSpark step ms",
                "peer step ms", "step ratio (rounds min-max)", "verdict", "DSpark anomalies",
                "peer anomalies")
"""The columns of the table of DSpark beside its peers, terminal and HTML alike."""
PEER_TEXT_COLUMNS = ("workload", "precision", "DSpark", "peer", "verdict", "DSpark anomalies",
                     "peer anomalies")
"""Those of :data:`PEER_COLUMNS` that hold words (left-aligned), the rest numbers."""
PEER_NOTE = (
    "step ratio: DSpark's step / the peer's, the median of the per-round ratios (each round's "
    "DSpark launch against the same round's peer launch), with the lowest and highest; below 1, "
    "DSpark is faster. Step ms: each engine's median step over every round. verdict: what every "
    "round says; 'rounds disagree' when they fall on both sides of 1 (the machine's noise exceeds "
    "the gap: more rounds, or benchmarks/side_by_side.py, which alternates the two step by step); "
    "'NOT TRUSTWORTHY' when either side was flagged busy_machine or ran with a fault injected. "
    "Both sides always come from one run.")
"""What the peer table's ratio is, printed under it."""


def peer_rows(results: Sequence[BenchResult]) -> list[list[str]]:
    """One text row of :data:`PEER_COLUMNS` per pairing of a DSpark strategy and its peer measured
    on 2 or more devices in ``results`` (see :mod:`dspark.bench.analyse.peer_ratios`); [] when none.

    Example::

        peer_rows(results)[0]   # ["gpt2-cpu", "2", "bf16", "32", "replicate", "torch-ddp", ...]
    """
    return [[p.workload, str(p.num_devices), p.precision, str(p.global_batch), p.ours, p.theirs,
             format_number(p.ours_ms), format_number(p.theirs_ms),
             f"{p.ratio:.3f} ({p.lowest:.3f}-{p.highest:.3f})",
             p.verdict + (f"; NOT TRUSTWORTHY ({', '.join(p.untrustworthy)})" if p.untrustworthy
                          else ""),
             ", ".join(p.ours_flags) or "-", ", ".join(p.theirs_flags) or "-"]
            for p in peer_ratios(results)]
