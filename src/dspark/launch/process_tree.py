"""Processes as the kernel lists them (through psutil): who is whose child, and whether a process
is still the one that was seen earlier (a pid is reused once its process is gone, so a process is
named by its pid *and* its start time).

``dspark run`` uses this to find torchrun's workers and to end the whole tree it started.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import psutil

__all__ = ["ProcessInfo", "children", "descendants", "is_running", "read_process", "signal_processes"]

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process: its pid, its parent's pid, and when it started."""

    pid: int
    ppid: int
    started_at: float
    """Seconds since the epoch (psutil's ``create_time``): the same value for the same process at
    every read, another for a later process given the same pid."""
    zombie: bool = False
    """It has exited and waits for its parent to collect its exit status."""


def read_process(pid: int) -> ProcessInfo | None:
    """The process ``pid`` as the kernel shows it now; None when there is none.

    Example::

        read_process(os.getpid()).ppid == os.getppid()   # True
    """
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return ProcessInfo(pid=pid, ppid=proc.ppid(), started_at=proc.create_time(),
                               zombie=proc.status() in _GONE)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def _live_processes() -> list[ProcessInfo]:
    found = []
    for proc in psutil.process_iter(["ppid", "create_time", "status"]):
        info = proc.info
        if info["status"] in _GONE or info["ppid"] is None or info["create_time"] is None:
            continue  # exited, or gone while being listed
        found.append(ProcessInfo(pid=proc.pid, ppid=info["ppid"], started_at=info["create_time"]))
    return found


def children(pid: int) -> list[ProcessInfo]:
    """The live processes whose parent is ``pid``, by pid.

    Example::

        [c.pid for c in children(torchrun_pid)]   # the workers torchrun started
    """
    return sorted((p for p in _live_processes() if p.ppid == pid), key=lambda p: p.pid)


def descendants(pid: int) -> list[ProcessInfo]:
    """Every live process below ``pid`` (children, their children, ...), parents before children.

    Example::

        descendants(os.getpid())   # [] for a process that started nothing
    """
    by_parent: dict[int, list[ProcessInfo]] = {}
    for proc in _live_processes():
        by_parent.setdefault(proc.ppid, []).append(proc)
    found: list[ProcessInfo] = []
    frontier = [pid]
    while frontier:
        nxt = []
        for parent in frontier:
            for child in sorted(by_parent.get(parent, ()), key=lambda p: p.pid):
                if child.pid != parent:  # pid 0 lists itself as its own parent
                    found.append(child)
                    nxt.append(child.pid)
        frontier = nxt
    return found


def is_running(pid: int, started_at: float | None = None) -> bool:
    """Whether process ``pid`` exists and has not exited; with ``started_at``, whether it is still
    the process that started then (not a later one given the same pid).

    Example::

        is_running(os.getpid())   # True
    """
    proc = read_process(pid)
    if proc is None:
        return False
    return not proc.zombie and (started_at is None or proc.started_at == started_at)


def signal_processes(procs: list[ProcessInfo], signum: int = signal.SIGKILL) -> list[int]:
    """Send ``signum`` to each process of ``procs`` that is still the same process; returns the pids
    that got it.

    Example::

        signal_processes(descendants(torchrun_pid), signal.SIGKILL)
    """
    sent = []
    for proc in procs:
        if not is_running(proc.pid, proc.started_at):
            continue
        try:
            os.kill(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            continue
        sent.append(proc.pid)
    return sent
