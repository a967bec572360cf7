"""The step breakdown: where this rank's time went in its last step (``engine.step_stats()``).

[Note: step breakdown] A *step* is an accumulation window: its ``grad_accum_steps`` micro-steps
(forward, the user's loss, ``engine.backward``) and ``engine.step()``. For this rank's last step:

* ``step_ms``: from the window's first training forward (grad enabled) to the end of ``step()``;
* ``data_ms``: from the end of the previous ``step()`` to this window's first forward: loading,
  moving and splitting the batch, and whatever else the loop does between steps (0.0 for the first
  step);
* ``comm_exposed_ms``: time blocked waiting for communication that compute did not hide: every
  wait on a collective inside the engine's phases (gradient buckets, the step's extras vector, zero3
  gathers, zero1/zero2 row gathers, buffer broadcasts, global BatchNorm statistics, the clipping or
  overflow norm, object collectives);
* ``forward_ms``, ``backward_ms``, ``optimizer_ms``: time inside the engine's forward calls,
  ``backward()`` calls and ``step()``, each *without* the exposed waits that happened inside it.
  ``backward_ms`` holds the gradient averaging that ends the window, ``optimizer_ms`` the update
  (and the reduction itself when ``step()`` ends a window early);
* ``compute_ms``: ``forward_ms + backward_ms + optimizer_ms``. Collectives equalise the ranks' wall
  time (a fast rank waits for the slow one), so the rank's own work, with the waits taken out, is
  what tells a straggler from its peers.

So ``forward_ms + backward_ms + optimizer_ms + comm_exposed_ms`` is ``step_ms`` less the time spent
outside the engine inside the window (the loss function, user code between calls): the tests hold
it close to ``step_ms`` for a step with a cheap loss (tests/engine/test_step_observer.py says how close).

CPU work is timed with ``time.perf_counter``; CUDA work with events on the current stream
(:mod:`dspark.engine.clocks`), read only when ``step_stats()`` is called. Forwards with grad disabled
(evaluation) are outside steps. The observer also feeds the engine's named trace ranges
(:mod:`dspark.engine.trace`).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from dspark import comm
from dspark.engine.clocks import Clock, clock_for
from dspark.engine.trace import COMM_WAIT, PHASE_RANGES, Range, TraceSession, ranges_enabled

__all__ = ["PHASES", "STEP_STATS_KEYS", "StepObserver", "observed"]

PHASES = ("forward", "backward", "optimizer")
STEP_STATS_KEYS = ("step_ms", "forward_ms", "backward_ms", "comm_exposed_ms", "optimizer_ms", "data_ms",
                   "compute_ms")
"""The keys of ``engine.step_stats()``; see [Note: step breakdown]."""

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


@dataclass(slots=True)
class _Window:
    """The marks of one accumulation window (floats on CPU, CUDA events on GPU)."""

    start: Any
    data_from: Any  # the previous window's end (owned by that window), or None
    phases: list[tuple[int, Any, Any]] = field(default_factory=list)  # (phase, start, end)
    waits: list[tuple[int, Any, Any]] = field(default_factory=list)  # (phase, start, end)
    marks: list[Any] = field(default_factory=list)  # every mark taken for this window, once
    end: Any = None
    resumed: Any = None  # where the next window's data time starts: the end, or after the trace's export
    stats: dict[str, float] | None = None


class StepObserver:
    """Times this rank's phases and the waits on collectives inside them (see [Note: step
    breakdown]); while a phase runs it is the comm layer's observer (``dspark.comm.set_observer``)."""

    def __init__(self, device: torch.device, *, rank: int, trace: TraceSession | None = None,
                 clock: Clock | None = None, step_count: Callable[[], int] = lambda: 0) -> None:
        self.rank = rank
        self._step_count = step_count
        self.trace = trace
        self._clock = clock or clock_for(device)
        self._window: _Window | None = None
        self._done: deque[_Window] = deque()  # the last two windows: the last one reads the other's end
        self._phase = -1  # the phase running now, -1: none
        self._phase_start: Any = None
        self._depth = 0
        self._saved: comm.CommObserver | None = None
        self._range: Range | None = None

    # -- phases ----------------------------------------------------------------------------------
    def enter(self, phase: int) -> None:
        self._depth += 1
        if self._depth > 1:  # a phase called from inside another: the outer one times it
            return
        mark = self._clock.stamp()
        if self._window is None:
            self._window = _Window(start=mark, data_from=self._done[-1].resumed if self._done else None)
        self._window.marks.append(mark)
        self._phase, self._phase_start = phase, mark
        self._saved = comm.set_observer(self)
        if ranges_enabled():
            self._range = Range(PHASE_RANGES[phase])
            self._range.__enter__()

    def leave(self, *, failed: bool = False, ends_step: bool = False) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        comm.set_observer(self._saved)
        self._saved = None
        window, phase = self._window, self._phase
        self._phase = -1
        if window is None:
            return
        if failed:  # the step is broken off: the next forward starts a new window
            self._window = None
            self._clock.release(window.marks)
            return
        mark = self._clock.stamp()
        window.marks.append(mark)
        window.phases.append((phase, self._phase_start, mark))
        if ends_step:
            window.end = window.resumed = mark
            self._window = None
            self._done.append(window)
            if len(self._done) > 2:
                self._clock.release(self._done.popleft().marks)
            if self.trace is not None and self.trace.after_step():
                # The profiler stepped or wrote its file: engine time, neither this step's nor
                # loading the next batch's.
                window.resumed = self._clock.stamp()
                window.marks.append(window.resumed)

    # -- the comm layer's observer -----------------------------------------------------------------
    def launch(self, kind: str, label: str | None, start: Callable[[], T]) -> T:
        if not ranges_enabled():
            return start()
        with Range(label or f"dspark.comm.{kind}"):
            return start()

    def wait(self, kind: str, label: str | None, wait: Callable[[], None]) -> None:
        window = self._window
        if window is None:
            wait()
            return
        before = self._clock.stamp()
        if ranges_enabled():
            with Range(COMM_WAIT), Range(label or f"dspark.comm.{kind}"):
                wait()
        else:
            wait()
        after = self._clock.stamp()
        window.marks += (before, after)
        window.waits.append((self._phase, before, after))

    def where(self) -> str | None:
        """``"engine step 3, backward"`` while a phase runs (the step counts the steps applied so
        far, as the engine's other messages do): named by a collective that timed out."""
        if self._phase < 0:
            return None
        return f"engine step {self._step_count()}, {PHASES[self._phase]}"

    # -- results ---------------------------------------------------------------------------------
    def step_stats(self) -> dict[str, float]:
        if not self._done:
            raise RuntimeError(f"rank {self.rank}: step_stats() before the first engine.step(); it "
                               "describes the last completed step")
        window = self._done[-1]
        if window.stats is None:
            window.stats = self._resolve(window)
        return dict(window.stats)

    def last_step_counts(self) -> tuple[int, int]:
        """How many phases and how many communication waits the last completed step had.

        Example::

            phases, waits = observer.last_step_counts()   # (3, 4): forward, backward, optimizer
        """
        if not self._done:
            raise RuntimeError(f"rank {self.rank}: last_step_counts() before the first engine.step()")
        window = self._done[-1]
        return len(window.phases), len(window.waits)

    def _resolve(self, window: _Window) -> dict[str, float]:
        elapsed = self._clock.elapsed_ms
        inside = [0.0] * len(PHASES)
        waited = [0.0] * len(PHASES)
        for phase, start, end in window.phases:
            inside[phase] += elapsed(start, end)
        for phase, start, end in window.waits:
            waited[phase] += elapsed(start, end)
        own = [max(0.0, inside[i] - waited[i]) for i in range(len(PHASES))]
        data_ms = 0.0 if window.data_from is None else elapsed(window.data_from, window.start)
        return {"step_ms": elapsed(window.start, window.end), "forward_ms": own[0],
                "backward_ms": own[1], "comm_exposed_ms": sum(waited), "optimizer_ms": own[2],
                "data_ms": data_ms, "compute_ms": sum(own)}

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def observed(phase: str, observer_of: Callable[[Any], StepObserver],
             ) -> Callable[[Callable[Concatenate[Any, P], R]], Callable[Concatenate[Any, P], R]]:
    """Decorate an engine method as one of the step's phases (``"forward"``, ``"backward"``,
    ``"optimizer"``; the last ends the step), observed by ``observer_of(self)``. A forward with grad
    disabled (evaluation) is not observed.

    Example::

        @observed("backward", lambda engine: engine.observer)
        def backward(self, loss): ...
    """
    index = PHASES.index(phase)
    ends_step = phase == "optimizer"

    def decorate(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
        @functools.wraps(method)
        def run(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
            observer = observer_of(self)
            if index == 0 and not torch.is_grad_enabled():
                return method(self, *args, **kwargs)
            observer.enter(index)
            try:
                out = method(self, *args, **kwargs)
            except BaseException:
                observer.leave(failed=True)
                raise
            observer.leave(ends_step=ends_step)
            return out
        return run
    return decorate
