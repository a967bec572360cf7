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

[Note: a level trimmed before] Where the steps change size (a sequence length that varies from batch
to batch), a long step that follows short ones is past the margin, and the step after its trim is a
short one: that rule alone trimmed at every long step (docs/figures.md#heap-ratchet-varlen), each
trim's pages faulted back in at the next. What tells such a step from a
ratchet is the heap's free memory (``mallinfo2``'s free blocks, which a trim leaves counted: it gives
back their pages, not the blocks). A ratchet lays each step's transients out in fresh memory, so its
free memory grows step after step, trims or not (zero3 with a large embedding on 2 ranks); a long
step that needs its memory reuses the blocks the last long step freed, so its free memory comes back
to where it was. So the guard keeps a level: the resident memory of a trim after
which the heap had not grown (no more free memory than at every earlier trim), and the most free
memory it trimmed at. A step past the margin that is within the margin of both (no more resident
memory than a level it needed before, on a heap no larger) is not trimmed. A ratchet still is, each
time its heap grows past the most it was trimmed at, or its resident memory past the level; and a
trim on a heap that grew does not raise the level (its resident memory holds the ratchet's fresh
pages): the level rises only on a heap of the same size, whose pages bound it.
"""

from __future__ import annotations

import dataclasses
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
        self._trimmed_at: HeapUsage | None = None   # its level and the most free memory it trimmed at
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
        margin = max(GROWTH_FLOOR_BYTES, base.resident_bytes * GROWTH_SHARE)
        past_margin = min(unexplained, heap_free_growth) > margin
        if past_margin and self._just_trimmed:  # a step that touched only what it needed is still past it:
            self._baseline, self._baseline_step = usage, self._steps  # the step needs more, not a ratchet
        self._just_trimmed = past_margin and not self._just_trimmed and not self._trimmed_before(usage, margin)
        if not self._just_trimmed:
            return
        self._trim()
        self.trims += 1
        seen = self._trimmed_at or usage
        heap_grew = usage.free_bytes > seen.free_bytes  # a ratchet's fresh memory: not a level to keep
        self._trimmed_at = dataclasses.replace(seen, free_bytes=max(seen.free_bytes, usage.free_bytes),
                                               resident_bytes=seen.resident_bytes if heap_grew
                                               else max(seen.resident_bytes, usage.resident_bytes))
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

    def _trimmed_before(self, usage: HeapUsage, margin: float) -> bool:
        """Whether ``usage`` is a level the guard trimmed at before: within ``margin`` of its level's
        resident memory and of the most free memory it trimmed at (see [Note: a level trimmed before])."""
        seen = self._trimmed_at
        return (seen is not None and usage.resident_bytes <= seen.resident_bytes + margin
                and usage.free_bytes <= seen.free_bytes + margin)
