"""A process's peak resident memory, recorded beside the tensor peak of one training step.

The tensor peak itself is measured by :mod:`dspark.planner.peak_memory` (the planner's one-device
probe measures the same way); its names are re-exported here for the lab's workers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.engine.for_the_lab import held_tensor_bytes, high_water_bytes, measure_peak_bytes, peak_of_running_sum

__all__ = ["held_tensor_bytes", "measure_peak_bytes", "peak_of_running_sum", "peak_rss_bytes",
           "reset_peak_rss"]


def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory to its current value (Linux: ``clear_refs``), so
    that :func:`peak_rss_bytes` covers only what runs next. False where that is not possible (the
    peak then covers the process's whole life).

    Example::

        scoped = reset_peak_rss(); train(); peak = peak_rss_bytes()
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """The peak resident memory of this process in bytes: ``VmHWM`` from ``/proc/self/status``,
    else ``ru_maxrss``. It counts every byte the process touched, tensors or not.

    Example::

        peak_rss_bytes()   # 412_000_000 for a worker that imported torch and trained a small model
    """
    return high_water_bytes(torch.device("cpu"))
