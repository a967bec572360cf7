"""The engine's guard against a CPU heap that grows without end (see [Note: the heap ratchet] in
:mod:`dspark.cpu_malloc`): after each optimizer step it reads the process, and when its resident
memory has grown past what the first steps settled at by more than the memory in use explains, it
gives the heap's free memory back to the kernel, saying so the first time.

[Note: when the guard trims] A training process allocates what it keeps (the optimizer's state
included) in its first optimizer step; the heap's layout after that step is the one every later step
could reuse. The guard takes its first reading, after ``SETTLE_STEPS`` steps, as the baseline. After
each later step, the growth it cannot explain is the resident memory's growth less the growth of what
is allocated (the heap's blocks in use and the blocks mapped apart): memory a program keeps on
purpose, a list of outputs or a cache, is allocated and never counts; nor does growth outside the
heap (Python's arenas of small objects are mapped apart from malloc, a memory-mapped file's pages are
resident once read), which the heap's free memory does not show. When both that growth and the
heap's free memory's growth past the baseline exceed
``max(GROWTH_FLOOR_BYTES, baseline resident * GROWTH_SHARE)``, the guard trims the heap
(``malloc_trim``): the holes the ratchet left go back to the kernel, and the next step faults in
only the pages it touches. When that step is still past the margin, it needs more (a longer
sequence) and its reading becomes the baseline: it is trimmed once, not after every step; a heap
that ratchets falls back below the margin, and is trimmed again each time it passes it.

The margin is small on purpose. A ratcheting heap grows by tens of MB at a time over the first
steps, and with the baseline after the third step and a margin of a tenth of the process, none of
that growth was trimmed in a short run: the same configuration's peak differed run to run by more
than the plan's error (docs/figures.md#plan-validation). With the baseline after the first step and
a margin of ``GROWTH_FLOOR_BYTES`` (or ``GROWTH_SHARE`` of a large process), a rank's peak stays
within the margin plus one step's growth of its first step's, in a short run as in a long one: the
process peak the plan predicts (see [Note: process memory] in :mod:`dspark.planner.process_memory`).
A trim costs page faults (the free memory the next step
reuses comes back zeroed), paid as often as the heap grows, never on a heap that does not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dspark.cpu_malloc import HeapUsage

__all__ = ["GROWTH_FLOOR_BYTES", "GROWTH_SHARE", "SETTLE_STEPS", "HeapGuard"]

log = logging.getLogger(__name__)

SETTLE_STEPS = 1
"""Optimizer steps before the baseline is read: the first allocates the optimizer's state (see
[Note: when the guard trims])."""
GROWTH_FLOOR_BYTES = 16 << 20
"""Unexplained growth past the baseline that is never trimmed, however small the process."""
GROWTH_SHARE = 0.02
"""... and as a share of the baseline's resident memory: the larger of the two is the margin."""


class HeapGuard:
    """Reads the process with ``read`` after each optimizer step (:meth:`after_step`) and calls
    ``trim()`` whenever its heap has ratcheted past the margin (see [Note: when the guard trims]).
    Reads nothing more once ``read`` gives None (not glibc, no ``/proc``).

    Example::

        guard = HeapGuard(read=cpu_malloc.heap_usage, trim=cpu_malloc.release_freed, rank=0)
        guard.after_step()   # after each optimizer step
    """

    def __init__(self, *, read: Callable[[], HeapUsage | None], trim: Callable[[], None], rank: int) -> None:
        self._read = read
        self._trim = trim
        self._rank = rank
        self._steps = 0
        self._baseline: HeapUsage | None = None
        self._baseline_step = 0
        self._just_trimmed = False
        self.trims = 0
        """How many times the guard gave the heap's free memory back."""
        self.off = False
        """True once ``read`` gave None: the guard reads no more."""

    def after_step(self) -> None:
        """One optimizer step ended: read the process, and trim the heap if it ratcheted."""
        if self.off:
            return
        self._steps += 1
        if self._steps < SETTLE_STEPS:
            return
        usage = self._read()
        if usage is None:
            self.off = True
            return
        if self._baseline is None:
            self._baseline, self._baseline_step = usage, self._steps
            return
        base = self._baseline
        allocated = (max(0, usage.in_use_bytes - base.in_use_bytes)
                     + max(0, usage.mapped_bytes - base.mapped_bytes))
        unexplained = usage.resident_bytes - base.resident_bytes - allocated
        # Only the heap's free memory is the ratchet's (and all a trim gives back): resident growth
        # outside the heap, Python's own arenas of small objects or a file's pages read, is not.
        heap_free_growth = usage.free_bytes - base.free_bytes
        past_margin = min(unexplained, heap_free_growth) > max(GROWTH_FLOOR_BYTES, base.resident_bytes * GROWTH_SHARE)
        if past_margin and self._just_trimmed:  # a step that touched only what it needed is still past it:
            self._baseline, self._baseline_step = usage, self._steps  # the step needs more, not a ratchet
        self._just_trimmed = past_margin and not self._just_trimmed
        if not self._just_trimmed:
            return
        self._trim()
        self.trims += 1
        if self.trims > 1:
            log.info("rank %d: the heap grew %.0f MB past what allocated memory explains after step %d: trimmed it "
                     "(%d times so far)", self._rank, unexplained / 1e6, self._steps, self.trims)
        else:
            log.warning("rank %d: resident memory grew from %.0f MB after step %d to %.0f MB after step %d, "
                        "%.0f MB more than the memory allocated: freed tensors were not reused (glibc's heap "
                        "fragmenting, see dspark.cpu_malloc); DSpark gave the heap's free memory back and will "
                        "each time it grows so again (DSPARK_CPU_MALLOC=lean avoids the growth, "
                        "DSPARK_HEAP_GUARD=off lets it grow)", self._rank, base.resident_bytes / 1e6,
                        self._baseline_step, usage.resident_bytes / 1e6, self._steps, unexplained / 1e6)
