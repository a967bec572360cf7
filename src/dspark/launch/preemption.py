"""Preemption: Slurm and Kubernetes send SIGTERM, then wait a grace period before they kill a job.
:func:`preemption_requested` turns that signal into a value every rank sees at the same step, so a
training loop can save a checkpoint and exit cleanly::

    for step in range(engine.step_count, total_steps):
        ...                                  # forward, backward, engine.step()
        if dspark.preemption_requested():    # every rank, at the same point of the loop
            engine.save(ckpt)
            break

[Note: preemption agreement] The SIGTERM handler only sets a flag in this process (a handler may
run between any two bytecodes, so it does nothing else). The signal may reach one rank and not
another, or reach them at different steps; so each call is one tiny all-reduce (max) of the flag
over the world, and every rank gets the same answer at the same call. Once True it stays True.
The handler is installed by the first call, so a program that never asks keeps SIGTERM's default
(it terminates). A handler the program had installed before is chained: it still runs, after the
flag is set. ``dspark run`` passes SIGTERM on to its workers (see :mod:`dspark.launch.launcher`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch

from dspark import comm

__all__ = ["PREEMPTION_SIGNALS", "preemption_requested"]

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)
"""The signals that request a preemption: what Slurm and Kubernetes send before they kill a job."""

_requested = False
_previous: dict[int, Any] = {}  # signal -> the handler installed before ours


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True
    previous = _previous.get(signum)
    if callable(previous):  # the program's own handler keeps working
        previous(signum, frame)


def _install() -> None:
    if _previous:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"rank {comm.get_world().rank}: the first dspark.preemption_requested() "
                           "call installs a SIGTERM handler, which Python allows only in the main "
                           "thread; call it from the main thread")
    for signum in PREEMPTION_SIGNALS:
        _previous[signum] = signal.signal(signum, _on_signal)


def preemption_requested() -> bool:
    """Whether the job was asked to stop (SIGTERM reached any rank): True on every rank at the same
    call. Collective (one all-reduce of one integer): call it on every rank at the same point of
    the loop, e.g. once per step. See [Note: preemption agreement].

    Example::

        if dspark.preemption_requested():
            engine.save(ckpt)
            break
    """
    global _requested
    _install()
    world = comm.get_world()
    flag = torch.tensor([1 if _requested else 0], dtype=torch.int32, device=world.device)
    comm.all_reduce(flag, op="max")
    agreed = bool(flag.item())  # not _requested: a signal landing now must not split the ranks
    if agreed:
        _requested = True
    return agreed


def _reset() -> None:
    """Forget any request and restore the handlers installed before ours (tests use it)."""
    global _requested
    for signum, previous in _previous.items():
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()
    _requested = False
