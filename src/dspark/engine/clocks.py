"""Clocks for the step breakdown: marks taken now, differences read later.

On CPU a mark is ``time.perf_counter()``: the host does the work, so host time is the work's time.
On CUDA the host only queues kernels, so a mark is a ``torch.cuda.Event`` recorded on the current
stream: the difference of two marks is the stream's time between them, waits on collectives included
(a stream blocked on an NCCL kernel stalls between the marks around the wait). Recording an event
costs no synchronisation; reading one does, so the step observer reads marks only when asked
(:meth:`dspark.Engine.step_stats`). Events are reused from a free list, never created per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

__all__ = ["Clock", "CpuClock", "CudaClock", "clock_for"]


class Clock(Protocol):
    def stamp(self) -> Any:
        """A mark for now (on CUDA: for the point the current stream has reached)."""
        ...

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds from ``start`` to ``end``; may block until both marks have happened."""
        ...

    def release(self, marks: Iterable[Any]) -> None:
        """``marks`` will not be read again: their resources may be reused."""
        ...


class CpuClock:
    """Host time: ``time.perf_counter`` (monotonic, sub-microsecond)."""

    def stamp(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def release(self, marks: Iterable[Any]) -> None:
        pass


class CudaClock:
    """Stream time on ``device``: timing events recorded on its current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.cuda.Event] = []

    def stamp(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        start.synchronize()
        end.synchronize()
        return float(start.elapsed_time(end))

    def release(self, marks: Iterable[Any]) -> None:
        self._free.extend(marks)


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on ``device``.

    Example::

        clock = clock_for(torch.device("cpu"))
        start = clock.stamp(); work(); clock.elapsed_ms(start, clock.stamp())
    """
    return CudaClock(device) if device.type == "cuda" else CpuClock()
