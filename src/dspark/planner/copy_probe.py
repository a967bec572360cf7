"""The fixed cost of one of the engine's small copies (see [Note: per-copy cost]).

Example::

    measure_per_copy_s(torch.device("cpu"))   # seconds one small copy_ into a flat buffer's view costs
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["PER_COPY_PROBE_COUNT", "measure_per_copy_s", "median_pass_s"]

# Note [per-copy cost]
# ~~~~~~~~~~~~~~~~~~~~
# The engine copies each fresh gradient into its bucket's flat buffer (replicate/zero1), packs each
# gradient into the send buffer (zero2/zero3) and lands each parameter's gathered rows: one ``copy_``
# per parameter, into a view of one flat buffer. Beyond its bytes, each such call pays a fixed cost
# (the dispatch, the view's checks, the kernel's launch), which a model of many small parameters pays
# many times for the same bytes; the probe's one flat copy (``Probe.copy_bytes_per_s``) never sees it.
# The probe times many tiny tensors copied one by one into slices of one buffer, as the engine does,
# and keeps the median per copy (``Probe.per_copy_s``); the plan prices each such term as
# ``copies * per_copy_s + bytes / copy_bytes_per_s`` (:mod:`dspark.planner.cost`).

PER_COPY_PROBE_COUNT = 256
"""Tiny tensors :func:`measure_per_copy_s` copies one by one in each repeat."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_per_copy_s(device: torch.device, count: int = PER_COPY_PROBE_COUNT, repeats: int = 5) -> float:
    """Seconds of one ``copy_`` of a tiny tensor (4x4 float32) into a view of a flat buffer on
    ``device``: ``count`` of them copied one by one into consecutive slices, the median of ``repeats``
    (after a warm-up) divided by ``count``; 0.0 for ``count < 1``.

    Example::

        measure_per_copy_s(torch.device("cpu"))
    """
    if count < 1:
        return 0.0
    flat = torch.empty(count * 16, dtype=torch.float32, device=device)
    views = [flat[16 * i:16 * (i + 1)].view(4, 4) for i in range(count)]
    sources = [torch.ones(4, 4, dtype=torch.float32, device=device) for _ in range(count)]

    def copy_all() -> None:
        for view, source in zip(views, sources, strict=True):
            view.copy_(source)

    return median_pass_s(device, copy_all, repeats) / count


def median_pass_s(device: torch.device, one_pass: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` runs of ``one_pass`` on ``device``, after one warm-up run.

    Example::

        median_pass_s(torch.device("cpu"), lambda: torch.ones(1 << 20).sum(), 5)
    """
    one_pass()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        one_pass()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
