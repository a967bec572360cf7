"""glibc's malloc, set for training on CPU: a step's freed tensor memory stays for the next step.

[Note: why the thresholds] PyTorch's CPU allocator is the C library's ``malloc``. glibc serves a
request above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and unmaps it on free, and gives the top of
the heap back to the kernel once more than ``M_TRIM_THRESHOLD`` of it is free; both thresholds move
on their own (the mmap one up to 32 MiB) as the program frees memory. A training step allocates and
frees the same activations and gradients every step, so memory handed back during one step is
asked for again in the next, and the kernel zeroes each 4 KiB page again on first touch: one page
fault per page. Whether that happens depends on where the moving thresholds have settled, so the
same step is fast in one process and slow in the next.

``DSPARK_CPU_MALLOC`` chooses:

* ``tuned`` (the default): the mmap threshold fixed at 32 MiB (the highest glibc would move it to)
  and no trimming, so every tensor up to 32 MiB is served from the heap and stays there between
  steps; larger ones are still mapped and unmapped, so the peak memory is glibc's own;
* ``heap``: every allocation up to 2 GiB from the heap, never trimmed: no page faults at all once
  the first steps have sized the heap, at the price of heap fragmentation (freed holes that a
  slightly larger later request cannot reuse) in the peak resident memory;
* ``lean``: every allocation of 1 MiB and more mapped afresh and unmapped on free, and the heap's
  free top trimmed at glibc's starting 128 KiB: the resident memory follows the live tensors most
  closely, at the price of page faults on every large tensor of every step (slower, most on a model
  of many mid-sized activations);
* ``default``: glibc's own moving thresholds.

What each choice costs in step time, page faults and peak resident memory is measured by
``OMP_NUM_THREADS=1 python benchmarks/cpu_malloc.py --workload W --batch B`` (each choice in its own
processes, interleaved) and published from its kept artifact in docs/figures.md#cpu-malloc.
``lean`` is for a run that must fit a memory budget, never a default.

[Note: the heap ratchet] With the heap keeping every tensor up to 32 MiB, a step whose large
transients live and die in an order that shifts from step to step (zero3's gathered embedding and
its gradients beside a language model's logits, on two ranks) leaves holes a little too small for
the next step's tensors: glibc extends the heap instead, every step. The memory in use stays flat
while the heap's free memory, resident, grows without end (tens of MB a step: a rank that trains long
runs out of memory). :class:`dspark.engine.heap_guard.HeapGuard` reads the process after each
optimizer step (:func:`heap_usage`) and, when its resident memory has grown past what the first
step took by more than the memory in use explains, gives the heap's free memory back to the
kernel (:func:`release_freed`), saying so the first time: the memory holds within a small margin of
the first step's, and a trim costs page faults only as often as the heap ratchets.
``DSPARK_HEAP_GUARD=off`` turns the guard off; it watches only under ``tuned`` (``heap``, ``lean``
and ``default`` are the user's own choice).

glibc's own thresholds are a matter of luck: in one process they settle well (no fault), in the
next they do not. GPT-2 124M's largest tensors (the embedding gradient, the logits and their
gradient) are above 32 MiB: only ``heap`` keeps them, faster for more peak memory, which is why it
is a choice and not the default.

:class:`dspark.Engine` calls :func:`tune_for_training` when its device is the CPU (the training
process, before its first step). It changes nothing when: the C library is not glibc, another
allocator is preloaded (``LD_PRELOAD`` with jemalloc, tcmalloc or mimalloc, which keep their own
caches), the user set glibc's malloc already (``GLIBC_TUNABLES`` with ``glibc.malloc``, or
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``), or ``DSPARK_CPU_MALLOC=default``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENV_VAR", "GUARD_ENV_VAR", "CpuMalloc", "HeapUsage", "advise_huge_pages", "current", "guard_wanted",
           "heap_usage", "mmap_threshold_bytes", "release_freed", "tune_for_training"]

log = logging.getLogger(__name__)

ENV_VAR = "DSPARK_CPU_MALLOC"
"""``tuned`` (the default), ``heap``, ``lean`` or ``default`` (see [Note: why the thresholds])."""

GUARD_ENV_VAR = "DSPARK_HEAP_GUARD"
"""``on`` (the default) or ``off``: the engine's heap guard (see [Note: the heap ratchet])."""

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int
_GLIBC_TRIM_THRESHOLD = 128 * 2**10  # glibc's starting value
# mode -> (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)
_THRESHOLDS = {"tuned": (32 * 2**20, _INT_MAX), "heap": (_INT_MAX, _INT_MAX),
               "lean": (2**20, _GLIBC_TRIM_THRESHOLD)}
_CHOICES = ("tuned", "heap", "lean", "default")
_MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>
_HUGE_PAGE_BYTES = 2 << 20
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@dataclass(frozen=True, slots=True)
class CpuMalloc:
    """What :func:`tune_for_training` did: ``mode`` is ``tuned``, ``heap`` or ``lean`` when DSpark set the
    thresholds, ``default`` when it left glibc's, and ``reason`` then says why."""

    mode: str
    reason: str = ""

    def describe(self) -> str:
        """One short label for reports: ``"dspark"``, ``"dspark heap"``, ``"dspark lean"`` or
        ``"default (<why>)"``."""
        if self.mode == "default":
            return f"default ({self.reason})"
        return "dspark" if self.mode == "tuned" else f"dspark {self.mode}"


@dataclass(frozen=True, slots=True)
class HeapUsage:
    """The C library's memory now (glibc's ``mallinfo2``) and the process's resident memory."""

    in_use_bytes: int
    """Bytes in the heap's allocated blocks."""
    free_bytes: int
    """Bytes free in the heap: holes and its free top, resident until trimmed or reused."""
    mapped_bytes: int
    """Bytes of the blocks mapped apart from the heap (each unmapped when freed)."""
    resident_bytes: int
    """The whole process's resident memory (``/proc/self/statm``)."""


_state: CpuMalloc | None = None


def current() -> CpuMalloc | None:
    """The outcome of this process's :func:`tune_for_training`, None before it ran."""
    return _state


def _choice(env: Mapping[str, str]) -> str:
    value = env.get(ENV_VAR, "").strip().lower() or "tuned"
    if value not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={env.get(ENV_VAR)!r}: expected one of {', '.join(_CHOICES)} "
                         "(tuned: tensors up to 32 MiB stay in the heap between steps; heap: all of "
                         "them, faster for large models at some peak memory; lean: tensors of 1 MiB "
                         "and more mapped afresh, the least peak memory at some speed; default: glibc's own "
                         "moving thresholds); see dspark.cpu_malloc")
    return value


def _reason_to_leave(env: Mapping[str, str]) -> str | None:
    if _choice(env) == "default":
        return f"{ENV_VAR}=default"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    preload = env.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} preloaded"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc"
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        if var in env:
            return f"{var} is set"
    return None


def mmap_threshold_bytes(env: Mapping[str, str] | None = None) -> int:
    """The size from which the C library maps an allocation afresh (and unmaps it on free) instead of
    serving it from its heap, under the setting :func:`tune_for_training` makes for ``env`` (default:
    this process's environment): 32 MiB for ``tuned``, and for glibc's own moving threshold the
    highest it moves to. A tensor below it stays in the heap once freed (see [Note: why the
    thresholds]).

    Example::

        mmap_threshold_bytes({"DSPARK_CPU_MALLOC": "lean"})   # 1048576
    """
    mode = _choice(os.environ if env is None else env)
    return _THRESHOLDS[mode][0] if mode in _THRESHOLDS else _THRESHOLDS["tuned"][0]


def tune_for_training(env: Mapping[str, str] | None = None) -> CpuMalloc:
    """Fix glibc's mmap and trim thresholds for training (see [Note: why the thresholds]); once per
    process, later calls return the first outcome. Raises ``ValueError`` on an unknown
    ``DSPARK_CPU_MALLOC``.

    Example::

        tune_for_training().describe()   # 'dspark', or e.g. 'default (DSPARK_CPU_MALLOC=default)'
    """
    global _state
    env = os.environ if env is None else env
    mode = _choice(env)  # a wrong value is an error on every call, not only the first
    if _state is not None:
        return _state
    reason = _reason_to_leave(env)
    if reason is None:
        reason = _set_thresholds(*_THRESHOLDS[mode])
    _state = CpuMalloc(mode) if reason is None else CpuMalloc("default", reason)
    log.debug("CPU malloc: %s", _state.describe())
    return _state


def release_freed() -> None:
    """Give the heap's free memory back to the kernel now (glibc's ``malloc_trim(0)``), where DSpark
    set the thresholds (:func:`tune_for_training`); nothing otherwise.

    [Note: one-off phases] The thresholds keep what a training step frees for the next step, which
    asks for it again. A one-off phase frees what nothing asks for again: building a zero3 model
    makes each parameter whole, keeps its rows and frees the rest, parameter after parameter, and
    with no trimming the freed pieces stayed resident between the shards, a varying amount from run
    to run. The engine calls this after each parameter of such a build, so a rank's peak is its
    shards plus one parameter (docs/figures.md#process-peak-rss).

    Example::

        release_freed()   # after a phase whose freed memory is not needed again
    """
    if _state is None or _state.mode == "default":
        return
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # else no malloc_trim in this C library: nothing to give back
        trim(0)


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask the kernel to back a fresh allocation of ``nbytes`` at ``address`` that the C library
    maps apart (at least :func:`mmap_threshold_bytes` under the thresholds DSpark set) with huge
    pages, before anything touches it; True when it was asked.

    [Note: huge pages for mapped storages] A storage the C library maps apart is unmapped when it
    is freed, so one allocated every step (zero3's gathered embedding, a large layer's gathered
    weight) is faulted in afresh every step, a fault for each 4 KiB page (on a virtual machine a
    fault costs more than the zeroing of its page). ``madvise(MADV_HUGEPAGE)`` over the huge
    pages inside the mapping (the kernel's transparent huge pages, on by default in its ``madvise``
    mode) makes that one fault per huge page: the same bytes resident, the same zeroing, 512 times
    fewer faults. Only mapped-apart storages are asked: a huge page inside the heap would stay
    resident after its tensor is freed. Nothing happens where DSpark did not set the thresholds
    (``heap`` keeps every tensor in the heap; ``default``, another allocator), or where the kernel
    refuses (no transparent huge pages: small pages as before).

    Example::

        full = torch.empty(n)   # about to be written whole
        advise_huge_pages(full.data_ptr(), full.numel() * full.element_size())
    """
    if _state is None or _state.mode not in ("tuned", "lean") or nbytes < _THRESHOLDS[_state.mode][0]:
        return False
    start = -(-address // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    stop = (address + nbytes) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    madvise = getattr(_libc(), "madvise", None)
    if stop <= start or madvise is None:  # DSpark set the thresholds: Linux with glibc
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return bool(madvise(start, stop - start, _MADV_HUGEPAGE) == 0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_usage() -> HeapUsage | None:
    """This process's heap and resident memory now (see :class:`HeapUsage`); None where the C
    library has no ``mallinfo2`` (not glibc, or glibc before 2.33) or there is no ``/proc``. A few
    microseconds: it walks the heap's free lists.

    Example::

        usage = heap_usage()   # HeapUsage(in_use_bytes=..., free_bytes=..., ...)
    """
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    try:
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return HeapUsage(in_use_bytes=int(info.uordblks), free_bytes=int(info.fordblks),
                     mapped_bytes=int(info.hblkhd), resident_bytes=resident)


def guard_wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the engine should run its heap guard in this process: ``DSPARK_HEAP_GUARD`` is not
    ``off`` and DSpark set the thresholds to ``tuned`` (see [Note: the heap ratchet]). Raises
    ``ValueError`` on a value other than ``on`` or ``off``.

    Example::

        guard_wanted({"DSPARK_HEAP_GUARD": "off"})   # False
    """
    env = os.environ if env is None else env
    value = env.get(GUARD_ENV_VAR, "").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"{GUARD_ENV_VAR}={env.get(GUARD_ENV_VAR)!r}: expected 'on' (the default: stop the "
                         "heap growing without end, see dspark.cpu_malloc) or 'off'")
    return value == "on" and _state is not None and _state.mode == "tuned"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once: ``find_library`` starts a program, too slow for every step."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> str | None:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return "no mallopt in the C library"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: a refused value changes nothing, while an accepted one (either) also
    # stops glibc from moving the other, which must then be set too.
    for param, name, value in ((_M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", mmap_threshold),
                               (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", trim_threshold)):
        if mallopt(param, value) != 1:
            return f"mallopt({name}) refused {value}"
    return None
