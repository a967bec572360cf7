"""Timing one collective piece of work on every rank alike: the ranks start together (a barrier),
and a GPU's queue is drained before the clock is read on either side.

Example::

    elapsed_ms = barrier_timed_ms(lambda: engine.step(), world.device)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dspark import comm

__all__ = ["barrier_timed_ms", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier_timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds ``fn()`` took on this rank, every rank starting after one barrier."""
    comm.barrier()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3
