"""Processes as the kernel lists them (Linux ``/proc``): who is whose child, and whether a process
is still the one that was seen earlier (a pid is reused once its process is gone, so a process is
named by its pid *and* its start time).

``dspark run`` uses this to find torchrun's workers and to end the whole tree it started; a
checkpoint save uses it to tell a live concurrent save from a dead one. Where ``/proc`` does not
exist (macOS) the functions answer from ``os.kill(pid, 0)`` alone, and the tree is unknown (empty).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcessInfo", "children", "descendants", "is_running", "read_process", "signal_processes"]

_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process: its pid, its parent's pid, and when it started (clock ticks since boot)."""

    pid: int
    ppid: int
    start_ticks: int
    zombie: bool = False
    """It has exited and waits for its parent to collect its exit status."""


def read_process(pid: int) -> ProcessInfo | None:
    """The process ``pid`` as ``/proc`` shows it now; None when there is none (or no ``/proc``).

    Example::

        read_process(os.getpid()).ppid == os.getppid()   # True
    """
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # "pid (comm) state ppid ..." where comm may hold spaces and parentheses: split at the last ")".
    fields = text[text.rfind(")") + 2:].split()
    try:
        return ProcessInfo(pid=pid, ppid=int(fields[1]), start_ticks=int(fields[19]),
                           zombie=fields[0] in ("Z", "X"))
    except (IndexError, ValueError):
        return None


def _all_processes() -> list[ProcessInfo]:
    try:
        names = os.listdir(_PROC)
    except OSError:
        return []
    found = (read_process(int(name)) for name in names if name.isdigit())
    return [p for p in found if p is not None]


def children(pid: int) -> list[ProcessInfo]:
    """The live processes whose parent is ``pid``, by pid.

    Example::

        [c.pid for c in children(torchrun_pid)]   # the workers torchrun started
    """
    return sorted((p for p in _all_processes() if p.ppid == pid and not p.zombie), key=lambda p: p.pid)


def descendants(pid: int) -> list[ProcessInfo]:
    """Every live process below ``pid`` (children, their children, ...), parents before children.

    Example::

        descendants(os.getpid())   # [] for a process that started nothing
    """
    by_parent: dict[int, list[ProcessInfo]] = {}
    for proc in _all_processes():
        if not proc.zombie:
            by_parent.setdefault(proc.ppid, []).append(proc)
    found: list[ProcessInfo] = []
    frontier = [pid]
    while frontier:
        nxt = []
        for parent in frontier:
            for child in sorted(by_parent.get(parent, ()), key=lambda p: p.pid):
                found.append(child)
                nxt.append(child.pid)
        frontier = nxt
    return found


def is_running(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` exists and has not exited; with ``start_ticks``, whether it is still
    the process that started then (not a later one given the same pid).

    Example::

        is_running(os.getpid())   # True
    """
    proc = read_process(pid)
    if proc is not None:
        return not proc.zombie and (start_ticks is None or proc.start_ticks == start_ticks)
    if _PROC.is_dir():
        return False
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def signal_processes(procs: list[ProcessInfo], signum: int = signal.SIGKILL) -> list[int]:
    """Send ``signum`` to each process of ``procs`` that is still the same process; returns the pids
    that got it.

    Example::

        signal_processes(descendants(torchrun_pid), signal.SIGKILL)
    """
    sent = []
    for proc in procs:
        if not is_running(proc.pid, proc.start_ticks):
            continue
        try:
            os.kill(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            continue
        sent.append(proc.pid)
    return sent
