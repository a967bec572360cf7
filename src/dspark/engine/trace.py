"""DSpark's phases and collectives as named ranges in profiler traces, and the engine's own trace option.

[Note: trace names] While named ranges are on, the engine marks

* its phases: ``dspark.forward`` (each training forward), ``dspark.backward`` (each
  ``engine.backward``), ``dspark.optimizer`` (each ``engine.step``);
* each collective where it starts, under the name its caller gave it: ``dspark.bucket3.all_reduce``
  (gradient bucket 3; ``reduce_scatter`` under zero2/zero3), ``dspark.gather.blocks.0`` (a
  zero3 unit's parameters; ``dspark.gather.root`` for the root's own), ``dspark.bucket3.all_gather``
  (zero1/zero2's updated rows), ``dspark.step_extras.all_reduce`` (the step's one small vector);
  unnamed ones as ``dspark.comm.<kind>``;
* every blocking wait for a collective as ``dspark.comm.wait``, with the collective's name inside.

Ranges go to PyTorch's profiler (``torch.profiler.record_function``: the ``user_annotation`` events of
a Chrome/Perfetto trace) and, on CUDA, to NVTX (``torch.cuda.nvtx``), so Nsight Systems shows the same
names. They are off unless asked for: with them off the engine makes no profiler call at all. Turn
them on around your own profiler with :func:`named_ranges`, or let the engine write a trace per rank
with ``Engine(trace_dir=...)`` (:class:`TraceSession`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from dspark import comm

__all__ = ["COMM_WAIT", "PHASE_RANGES", "Range", "TraceSession", "check_no_outer_profiler", "named_ranges",
           "ranges_enabled", "trace_range"]

PHASE_RANGES = ("dspark.forward", "dspark.backward", "dspark.optimizer")
"""Range names of the engine's phases, in the order of :data:`dspark.engine.step_observer.PHASES`."""
COMM_WAIT = "dspark.comm.wait"

_enabled = 0  # how many callers want ranges now (named_ranges() nests; trace sessions overlap)
_NULL = contextlib.nullcontext()
log = logging.getLogger(__name__)
_running: weakref.WeakSet[TraceSession] = weakref.WeakSet()


def _close_running() -> None:
    """Stop every trace still recording: a profiler left running past ``dspark.shutdown()`` or into
    the interpreter's exit crashes the process (SIGSEGV in the profiler's teardown)."""
    for session in list(_running):
        session.close()


comm.add_shutdown_hook(_close_running)
atexit.register(_close_running)


def ranges_enabled() -> bool:
    """Whether DSpark emits its named ranges now."""
    return _enabled > 0


@contextlib.contextmanager
def named_ranges() -> Iterator[None]:
    """Emit DSpark's named ranges (see [Note: trace names]) while the block runs: for a profiler (or
    Nsight Systems) that you run yourself around engine steps.

    Example::

        with torch.profiler.profile() as prof, dspark.engine.named_ranges():
            for x, y in batches:
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        prof.export_chrome_trace(f"rank{world.rank}.json")
    """
    global _enabled
    _enabled += 1
    try:
        yield
    finally:
        _enabled -= 1


class Range:
    """One named range: a profiler ``record_function`` and, with CUDA, an NVTX range."""

    __slots__ = ("_name", "_nvtx", "_record")

    def __init__(self, name: str) -> None:
        self._name = name
        self._record: Any = None
        self._nvtx = False

    def __enter__(self) -> Range:
        self._record = torch.profiler.record_function(self._name)
        self._record.__enter__()
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_push(self._name)
            self._nvtx = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._record.__exit__(kind, exc, tb)


def trace_range(name: str) -> contextlib.AbstractContextManager[Any]:
    """A :class:`Range` named ``name`` while ranges are on, else a shared no-op context.

    Example::

        with trace_range("dspark.checkpoint.save"):
            engine.save(path)
    """
    return Range(name) if _enabled else _NULL


def check_no_outer_profiler(trace_dir: str | os.PathLike[str] | None) -> None:
    """``RuntimeError`` when ``trace_dir`` is given while a PyTorch profiler is already recording (the
    option's own values are checked by :class:`dspark.engine.config.ObservationConfig`)."""
    if trace_dir is not None and torch.autograd.profiler._is_profiler_enabled:
        raise RuntimeError(
            f"Engine(trace_dir={str(trace_dir)!r}) while a PyTorch profiler is already recording "
            "(torch.profiler.profile() around this code): PyTorch runs one profiler per process, and "
            "a second one started inside it loses the outer trace or crashes at exit. Keep your "
            "profiler and leave trace_dir out, turning DSpark's named ranges on inside it "
            "(with torch.profiler.profile() as prof, dspark.engine.named_ranges(): ...); or build "
            "the engine with trace_dir outside your profiler")


class TraceSession:
    """The engine's own trace: a PyTorch profiler on this rank for ``warmup + active`` steps, written
    as Chrome/Perfetto JSON to ``trace_dir/rank{rank}.json`` once the ``active`` steps are done.

    The first ``warmup`` steps run untraced (the last of them also warms the profiler up), then
    ``active`` steps are recorded with named ranges on. Call :meth:`after_step` at the end of each
    step; :meth:`close` stops early (writing what was recorded, if anything, with a warning that says
    how many steps it holds). ``engine.close()``, ``dspark.shutdown()`` and the interpreter's exit
    close a session still running.
    """

    def __init__(self, trace_dir: str | os.PathLike[str], *, rank: int, warmup: int, active: int,
                 device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.path = Path(trace_dir) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        plan = schedule(wait=max(warmup - 1, 0), warmup=min(warmup, 1), active=active, repeat=1)
        self._profiler: Any = profile(activities=activities, schedule=plan, on_trace_ready=self._write)
        self._warmup, self._active = warmup, active
        self._steps_left = warmup + active
        self._ranges = named_ranges()
        self._ranges.__enter__()
        self._profiler.start()
        _running.add(self)

    def _write(self, profiler: Any) -> None:
        profiler.export_chrome_trace(str(self.path))

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def after_step(self) -> bool:
        """One engine step ended: advance the profiler's schedule; stop once the trace is written.
        Returns whether the profiler was running (and so took time of its own)."""
        if self._profiler is None:
            return False
        self._profiler.step()
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.close()
        return True

    def close(self) -> None:
        """Stop the profiler (idempotent) and turn this session's named ranges off."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        _running.discard(self)
        done = self._warmup + self._active - self._steps_left
        try:
            profiler.stop()
        finally:
            self._ranges.__exit__(None, None, None)
        if self._steps_left > 0:
            traced = max(0, done - self._warmup)
            held = (f"{self.path} holds the {traced} traced step(s)" if traced
                    else "no trace was written")
            log.warning("trace_steps=(%d, %d): training stopped after %d step(s), before the trace was "
                        "complete; %s", self._warmup, self._active, done, held)
