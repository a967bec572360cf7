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
  closely, at the price of page faults on every large tensor of every step (slower, by up to 1.8x
  on a model of many mid-sized activations);
* ``default``: glibc's own moving thresholds.

Measured on a 2-core AMD EPYC VM (torch 2.13 CPU), the engine on one rank and one core, AdamW,
each choice in its own processes, interleaved; median step, page faults of a median step, peak
resident memory (``OMP_NUM_THREADS=1 python benchmarks/cpu_malloc.py --workload W --batch B``;
2 rounds x 6 steps, GPT-2 124M 1 round x 3 steps in fp32):

=============================  ==========================  ==========================  ==========================
workload                       ``default``                 ``tuned``                   ``heap``
=============================  ==========================  ==========================  ==========================
gpt2-cpu, batch 16, bf16       271 ms, 28,768, 545 MB      226 ms, 0, 567 MB           229 ms, 0, 556 MB
resnet50-cpu, batch 64, bf16   195 ms, 0, 542 MB           193 ms, 0, 550 MB           195 ms, 0, 564 MB
GPT-2 124M, 1 x 1024, fp32     10.0 s, 320,223, 3073 MB    9.8 s, 314,111, 3117 MB     8.2 s, 37,692, 3538 MB
=============================  ==========================  ==========================  ==========================

The same commands with ``--precision fp32`` on a 2-core Intel Xeon VM with AMX, with
``lean`` (DSpark ``56c1a43`` plus the commit that adds ``lean``, 2026-12-01 20:55-21:00 UTC):

=============================  ======================  ======================  ======================  ======================
workload                       ``default``             ``tuned``               ``heap``                ``lean``
=============================  ======================  ======================  ======================  ======================
gpt2-cpu, batch 16             404 ms, 13,792, 610 MB  389 ms, 0, 637 MB       391 ms, 0, 603 MB       496 ms, 97,604, 541 MB
resnet50-cpu, batch 64         442 ms, 19,561, 793 MB  429 ms, 0, 766 MB       420 ms, 2, 722 MB       769 ms, 337,138, 602 MB
GPT-2 124M, 1 x 1024           6.0 s, 346,335, 3057 MB 5.6 s, 314,112, 3122 MB 6.0 s, 50,258, 3919 MB  6.0 s, 746,941, 2934 MB
=============================  ======================  ======================  ======================  ======================

On 2 ranks the saving is larger (GPT-2 124M, fp32, 1 x 1024 tokens per rank, one timed step,
``dspark bench --workloads gpt2-124m --devices 2 --global-batch 2 --precision fp32 --warmup 0
--steps 1 --rounds 1`` with and without ``DSPARK_CPU_MALLOC=lean``): peak RSS per rank
``replicate`` 3364 -> 3087 MB, step 6.6 -> 8.8 s; ``zero3`` 2769 -> 2342 MB, step 8.1 -> 9.1 s.
``lean`` is for a run that must fit a memory budget, never a default.

glibc's own thresholds are a matter of luck: in the resnet50-cpu processes above they had settled
well (no fault), in the gpt2-cpu ones they had not. GPT-2 124M's largest
tensors (the 154 MB embedding gradient, the 206 MB logits and their gradient) are above 32 MiB:
only ``heap`` keeps them, 18% faster for 15% more peak memory, which is why it is a choice and not
the default.

:class:`dspark.Engine` calls :func:`tune_for_training` when its device is the CPU (the training
process, before its first step). It changes nothing when: the C library is not glibc, another
allocator is preloaded (``LD_PRELOAD`` with jemalloc, tcmalloc or mimalloc, which keep their own
caches), the user set glibc's malloc already (``GLIBC_TUNABLES`` with ``glibc.malloc``, or
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``), or ``DSPARK_CPU_MALLOC=default``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENV_VAR", "CpuMalloc", "current", "tune_for_training"]

log = logging.getLogger(__name__)

ENV_VAR = "DSPARK_CPU_MALLOC"
"""``tuned`` (the default), ``heap``, ``lean`` or ``default`` (see [Note: why the thresholds])."""

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int
_GLIBC_TRIM_THRESHOLD = 128 * 2**10  # glibc's starting value
# mode -> (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)
_THRESHOLDS = {"tuned": (32 * 2**20, _INT_MAX), "heap": (_INT_MAX, _INT_MAX),
               "lean": (2**20, _GLIBC_TRIM_THRESHOLD)}
_CHOICES = ("tuned", "heap", "lean", "default")
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


def _set_thresholds(mmap_threshold: int, trim_threshold: int) -> str | None:
    path = ctypes.util.find_library("c") or "libc.so.6"
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError) as err:
        return f"no mallopt in {path}: {err}"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: a refused value changes nothing, while an accepted one (either) also
    # stops glibc from moving the other, which must then be set too.
    for param, name, value in ((_M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", mmap_threshold),
                               (_M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", trim_threshold)):
        if mallopt(param, value) != 1:
            return f"mallopt({name}) refused {value}"
    return None
