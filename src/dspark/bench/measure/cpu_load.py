"""One CPU core per rank: pinning every thread of a worker to its core, and measuring what else ran
on that core while the rank was being timed.

[Note: pinning every thread] ``sched_setaffinity(0, ...)`` pins only the calling thread. Threads a
process starts later inherit the mask, so the worker pins itself *before* ``dspark.init()`` creates
gloo's threads, and pins every thread the kernel lists for it again once the engine exists
(whatever started threads in between). :func:`pin_all_threads` reports how many threads it saw and
how many it pinned, and the result records it.

[Note: load over the timed window] On CPU one device is one core, so any other process that runs on
a rank's core during its timed steps takes time from it. Each rank reads, right before and right
after its timed steps, the kernel's counters of its own core (``cpuN`` in ``/proc/stat``, read
through psutil: busy and steal time) and its own CPU time (all its threads, which are pinned to that
core). What the core was busy with beyond the rank's own time was someone else's work (another
process, or the hypervisor's ``steal``). The whole machine's counters give the same figure across
all cores. The kernel counts in ticks of ``1 / SC_CLK_TCK`` seconds, so a window under a second says
little; the timed steps of a configuration take longer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

__all__ = ["CpuSnapshot", "RankLoad", "core_for_rank", "cpu_snapshot", "pin_all_threads",
           "thread_ids", "window_load"]


def core_for_rank(local_rank: int, local_world_size: int) -> int | None:
    """The core local rank ``local_rank`` owns (the ``local_rank``-th core this process may use),
    or None when there are fewer cores than ranks on this node (then nobody is pinned).

    Example::

        core_for_rank(1, 2)   # 1 on a 2-core box
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if local_world_size > len(cores) or not 0 <= local_rank < local_world_size:
        return None
    return cores[local_rank]


def thread_ids() -> list[int]:
    """The ids of every thread of this process (``[pid]`` where the kernel does not list them).

    Example::

        len(thread_ids())   # 1 in a fresh single-threaded interpreter
    """
    try:
        return sorted(thread.id for thread in psutil.Process().threads())
    except psutil.Error:
        return [os.getpid()]


def pin_all_threads(core: int) -> tuple[int, int]:
    """Pin every thread of this process to ``core``; ``(threads seen, threads on that core only)``.

    A thread that exits while being pinned is not counted (see [Note: pinning every thread]).

    Example::

        pin_all_threads(0)   # (3, 3)
    """
    seen = pinned = 0
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, {core})
            seen += 1
            pinned += os.sched_getaffinity(tid) == {core}
        except (ProcessLookupError, PermissionError, OSError):
            continue  # the thread ended between listing and pinning
    return seen, pinned


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuSnapshot:
    """Counters read at one instant (seconds)."""

    wall_s: float
    own_cpu_s: float
    """CPU time of this process, all threads."""
    core_busy_s: float | None
    """Busy time of the rank's core (user, nice, system, irq, softirq), None when unknown."""
    core_steal_s: float | None
    machine_busy_s: float | None
    """The same over all cores."""
    machine_steal_s: float | None


def _busy_and_steal(times: object) -> tuple[float, float]:
    """(busy_s, steal_s) of one of psutil's ``cpu_times`` rows (steal is Linux's alone)."""
    busy = sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
    return float(busy), float(getattr(times, "steal", 0.0))


def _stat_lines() -> dict[str, tuple[float, float]]:
    """``{"cpu": (busy_s, steal_s), "cpu0": ..., ...}``: the machine's and each core's counters."""
    out = {"cpu": _busy_and_steal(psutil.cpu_times())}
    for core, times in enumerate(psutil.cpu_times(percpu=True)):
        out[f"cpu{core}"] = _busy_and_steal(times)
    return out


def cpu_snapshot(core: int | None) -> CpuSnapshot:
    """Read the counters now; ``core`` is the rank's core (None: only the machine's).

    Example::

        before = cpu_snapshot(0); work(); load = window_load(before, cpu_snapshot(0), core=0)
    """
    lines = _stat_lines()
    core_line = lines.get(f"cpu{core}") if core is not None else None
    machine = lines.get("cpu")
    return CpuSnapshot(wall_s=time.monotonic(), own_cpu_s=time.process_time(),
                       core_busy_s=core_line[0] if core_line else None,
                       core_steal_s=core_line[1] if core_line else None,
                       machine_busy_s=machine[0] if machine else None,
                       machine_steal_s=machine[1] if machine else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankLoad:
    """What ran on one rank's core during its timed window (see [Note: load over the timed window])."""

    rank: int
    core: int | None
    """The core the rank was pinned to; None when it was not pinned."""
    window_s: float
    own_cpu_s: float
    """CPU time the rank's process used in the window (all its threads)."""
    foreign_cpu_s: float | None
    """Busy time of the rank's core that was not the rank's: other processes."""
    steal_s: float | None
    """Time the hypervisor gave the rank's core to another machine."""
    machine_busy_s: float | None
    """Busy time of all cores in the window (for the whole-machine figure)."""
    threads: int = 0
    threads_pinned: int = 0
    """Threads of the rank's process, and how many of them ran on its core only."""

    @property
    def foreign_share(self) -> float | None:
        """Share of the window the core spent on other processes or stolen (0..1)."""
        if self.foreign_cpu_s is None or self.window_s <= 0:
            return None
        return (self.foreign_cpu_s + (self.steal_s or 0.0)) / self.window_s


def window_load(before: CpuSnapshot, after: CpuSnapshot, *, rank: int, core: int | None,
                threads: tuple[int, int] = (0, 0)) -> RankLoad:
    """The load of ``core`` between two snapshots of this rank.

    Example::

        window_load(before, after, rank=0, core=0).foreign_share   # 0.02 on a quiet machine
    """
    window_s = after.wall_s - before.wall_s
    own_s = after.own_cpu_s - before.own_cpu_s
    foreign = steal = None
    if (before.core_busy_s is not None and after.core_busy_s is not None
            and before.core_steal_s is not None and after.core_steal_s is not None):
        # Ticks and the process clock are read at slightly different instants: never below 0.
        foreign = max(0.0, (after.core_busy_s - before.core_busy_s) - own_s)
        steal = max(0.0, after.core_steal_s - before.core_steal_s)
    machine = (after.machine_busy_s - before.machine_busy_s
               if before.machine_busy_s is not None and after.machine_busy_s is not None else None)
    return RankLoad(rank=rank, core=core, window_s=window_s, own_cpu_s=own_s,
                    foreign_cpu_s=foreign, steal_s=steal, machine_busy_s=machine,
                    threads=threads[0], threads_pinned=threads[1])
