"""The memory a user sees a rank's process take, predicted from its tensor peak.

[Note: process memory] The plan's tensor peak is what PyTorch's tensors occupy at the step's highest
moment. What a user budgets for, and what ``memory_budget`` means, is the process:

* **CPU**: its resident memory at its peak (``VmHWM``): the *libraries* a rank loads (the
  interpreter, PyTorch, DSpark's engine and what it imports on construction, the modules the
  model's classes come from), measured by starting a fresh process that imports them, initialises
  DSpark and runs one engine step of a two-parameter model (:func:`library_baseline_bytes`, a few
  seconds, once per process and set of modules); plus the tensor peak; plus what the C library's
  heap holds beyond the live tensors in it, which depends on how long those tensors live:

  - a step's *transients* (activations, the whole gradients before they are reduced, zero3's
    gathered parameters, autocast's copies) are freed every step, and the next step's land only
    partly where they were: the holes they leave stay resident. Only those below the size the C
    library maps apart (:func:`dspark.cpu_malloc.mmap_threshold_bytes`) are in its heap: a larger
    one (a language model's logits, a large batch's activation) is mapped when allocated and
    unmapped when freed, and leaves no hole. So the heap holds :data:`HEAP_SHARE` more of the most
    the step's transients held *in the heap* at once, at whatever moment of the step that was (not
    necessarily its tensor peak: where the logits make the peak, mapped apart, the heap's own
    high-water may come earlier, from activations below the size). The probe measures it
    (``Probe.heap_step_bytes``: the running sum of the step's allocations below that size, beyond
    the gradients of that size, which one device keeps), by batch; a strategy's own transients
    beyond the one-device step (zero3's gathered units, whole gradients before their reduction,
    send buffers: the row's tensor peak less its model state less the probe's step) count in the
    heap as well. A probe that did not measure it (a fake trace, an older plan's JSON) counts every
    transient at the peak in the heap. Left alone the heap grows step after step (the ratchet,
    [Note: the heap ratchet] in :mod:`dspark.cpu_malloc`); the engine's heap guard trims it back
    whenever it passes a small margin over the first step's ([Note: when the guard trims] in
    :mod:`dspark.engine.heap_guard`), so the share describes a short run and a long one alike;
  - the *model state* (parameters, gradients, optimizer state) is allocated once and kept: it
    leaves no holes, and its part below that size adds :data:`STATE_HEAP_SHARE` of it;
  - under zero3 on several ranks, a gathered parameter's storage from half that size up to it (a
    large embedding) ratchets the heap: the storage and its whole gradient, the largest blocks the
    heap holds, die each step in an order that shifts, and the next step's land in fresh memory (the
    heap's free memory grows by two of them a step). The guard lets a step's growth stand until the
    next reading, so the rank holds one step's ratchet beyond its first step's
    (:func:`ratchet_step_bytes`: two of the largest such storage). Smaller storages find holes of
    their size among the step's other transients;

  plus, on a world of several ranks,
  :data:`RANK_BYTES` (the process group's buffers and threads) and a copy of the two largest
  gradient buckets below that size (gloo's threads reduce through copies in heaps of their own).
* **GPU**: the device memory the process takes: the caching allocator's reserved peak (the tensor
  peak times the reserved-to-allocated ratio the probe measured on that device) plus the CUDA
  context and libraries (the device's used memory beyond the reserved, measured by the probe).

The constants are fitted, not chosen: by least squares over the validation zoo's measured process
peaks on 1 and 2 CPU ranks (``benchmarks/plan_validation.py``, the guard on), and checked against
rows the fit did not see (3 and 4 ranks); how close the prediction comes, on every row, is in
docs/figures.md#plan-validation. The split between transients and state is what the zoo asks for:
one share of all the tensors in the heap read the activation-heavy rows (one rank of a long
sequence, a conv net) and zero3's gathered embedding low and the rows of large optimizer state high.
So is the heap's high-water in place of the transients at the peak: a share of the latter read one
rank of a long sequence (every activation in the heap) low and one rank of a language model (its
logits mapped apart) high.
The heap stays the least predictable part: a rank's first step lays its transients out a little
differently run to run, which is why ``strategy="auto"`` keeps a margin
(:data:`dspark.planner.table.PEAK_MARGIN`).
"""

from __future__ import annotations

import functools
import os
import resource
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dspark.cpu_malloc import mmap_threshold_bytes
from dspark.planner.peak_memory import held_tensor_bytes

__all__ = ["HEAP_SHARE", "RANK_BYTES", "STATE_HEAP_SHARE", "high_water_bytes", "library_baseline_bytes",
           "model_modules", "process_bytes", "process_peak_bytes", "process_terms", "ratchet_step_bytes",
           "this_process_baseline_bytes"]

HEAP_SHARE = 0.70
"""CPU: the heap's resident memory beyond a step's live tensors, as a share of the most its
transients hold at once in the heap (see [Note: process memory])."""
STATE_HEAP_SHARE = 0.27
"""CPU: the same for the model state in the heap, allocated once (see [Note: process memory])."""
RANK_BYTES = 32 << 20
"""CPU: what a rank of a world of several holds beyond one process (see [Note: process memory])."""

_BASELINE_SCRIPT = """
import functools, importlib, sys
import torch
import dspark
for name in sys.argv[1:]:
    importlib.import_module(name)
dspark.init()
engine = dspark.Engine(torch.nn.Linear(2, 2), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
engine.backward(engine(torch.ones(1, 2)).sum())
engine.step()
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) * 1024)
"""


def model_modules(model: nn.Module) -> tuple[str, ...]:
    """The importable modules ``model``'s classes come from, beyond PyTorch's (``__main__``, which a
    fresh process cannot import, left out).

    Example::

        model_modules(GPT2LMHeadModel(config))   # ("transformers.models.gpt2.modeling_gpt2",)
    """
    names = {type(m).__module__ for m in model.modules()}
    return tuple(sorted(n for n in names if n != "__main__" and not n.startswith(("torch.", "builtins"))))


@functools.lru_cache(maxsize=8)
def library_baseline_bytes(modules: Iterable[str] = ()) -> int:
    """The peak resident bytes of a fresh process that imports PyTorch, DSpark and ``modules``,
    initialises DSpark (one process) and runs one engine step on a two-parameter model: what every
    rank holds before its model (see [Note: process memory]). 0 where it cannot be measured (not
    Linux, or the process failed).

    Example::

        library_baseline_bytes(("transformers.models.gpt2.modeling_gpt2",))   # bytes
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    try:
        out = subprocess.run([sys.executable, "-c", _BASELINE_SCRIPT, *modules], capture_output=True,
                             text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"}, check=True)
        return int(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def ratchet_step_bytes(gathered_storage_bytes: Iterable[int]) -> int:
    """One step's growth of a heap that ratchets under zero3 on several CPU ranks: twice the largest
    gathered storage from half :func:`dspark.cpu_malloc.mmap_threshold_bytes` up to it (the storage
    and its whole gradient, see [Note: process memory]); 0 where there is none.

    Example::

        ratchet_step_bytes([31 << 20, 1 << 20])   # 62 << 20: the large storage and its gradient
    """
    limit = mmap_threshold_bytes()
    return 2 * max((n for n in gathered_storage_bytes if limit // 2 <= n < limit), default=0)


def process_peak_bytes(tensor_peak_bytes: int, *, device_type: str, num_ranks: int, baseline_bytes: int,
                       allocator_share: float, mapped_bytes: int = 0, collective_heap_bytes: int = 0,
                       state_bytes: int = 0, heap_transient_bytes: int | None = None,
                       ratchet_bytes: int = 0) -> int | None:
    """A rank's process peak from its tensor peak (see [Note: process memory]); None where the
    baseline was not measured. ``mapped_bytes``: the part of the tensor peak in allocations the C
    library maps apart from its heap (on a CPU: each of at least
    :func:`dspark.cpu_malloc.mmap_threshold_bytes`), which the heap's share does not grow;
    ``collective_heap_bytes``: the two largest gradient buckets below that size, which gloo's
    threads copy into heaps of their own on a world of several; ``state_bytes``: the model state
    (parameters, gradients, optimizer state: allocated once and kept), on a CPU the part of the tensor
    peak that is not a step's transients (0: all of it is); ``heap_transient_bytes``: on a CPU the
    most the step's transients hold at once in the heap (allocations below that size, at any moment
    of the step: ``Probe.heap_step_bytes``), which the heap's share follows (None: the transients
    at the peak, all of them in the heap); ``ratchet_bytes``: on a CPU, one step's growth of a heap
    that ratchets (:func:`ratchet_step_bytes`), held beyond the first step's.

    Example::

        process_peak_bytes(200_000_000, device_type="cpu", num_ranks=2, baseline_bytes=320_000_000,
                           allocator_share=HEAP_SHARE, state_bytes=120_000_000, heap_transient_bytes=50_000_000)
    """
    if baseline_bytes <= 0:
        return None
    in_heap = max(0, tensor_peak_bytes - mapped_bytes)
    if device_type != "cpu":
        return round(baseline_bytes + tensor_peak_bytes + in_heap * allocator_share)
    transient = min(in_heap, max(0, tensor_peak_bytes - state_bytes))
    in_heap_transient = transient if heap_transient_bytes is None else max(0, heap_transient_bytes)
    extra = RANK_BYTES + collective_heap_bytes + ratchet_bytes if num_ranks > 1 else 0
    return round(baseline_bytes + tensor_peak_bytes + in_heap_transient * allocator_share
                 + (in_heap - transient) * STATE_HEAP_SHARE + extra)


def process_terms(model: nn.Module, device: torch.device, library_baseline: bool) -> dict[str, Any]:
    """``process_baseline_bytes`` and ``allocator_share`` for a probe on ``device`` (see [Note:
    process memory]): on a CPU a fresh process's libraries and the heap's measured share; on a GPU
    the context (the device's used memory beyond what the allocator reserved) and the allocator's
    reserved-to-allocated ratio after the probe's steps.

    Example::

        process_terms(model, torch.device("cpu"), library_baseline=True)   # {"process_baseline_bytes": ..., ...}
    """
    if device.type != "cuda":
        baseline = library_baseline_bytes(model_modules(model)) if library_baseline else 0
        return {"process_baseline_bytes": baseline, "allocator_share": HEAP_SHARE}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    allocated = max(1, int(torch.cuda.max_memory_allocated(device)))
    return {"process_baseline_bytes": max(0, total - free - reserved),
            "allocator_share": max(0.0, reserved / allocated - 1.0)}


def this_process_baseline_bytes(device: torch.device) -> int:
    """What this process holds besides its tensors, read now: on a CPU its resident memory less
    every tensor it can reach, on a GPU the device's used memory beyond what the allocator reserved
    (the context, the libraries). ``strategy='auto'`` reads it in the rank that will train (see
    [Note: process memory]). 0 where it cannot be read.

    Example::

        this_process_baseline_bytes(torch.device("cpu"))   # bytes
    """
    if device.type == "cuda":
        return max(0, process_bytes(device) - torch.cuda.memory_reserved(device))
    rss = process_bytes(device)
    return max(0, rss - held_tensor_bytes("cpu")) if rss else 0


def high_water_bytes(device: torch.device) -> int:
    """The highest this process's memory has been so far, in the sense ``memory_budget`` counts it:
    on a CPU its peak resident memory (``VmHWM``, else ``ru_maxrss``), on a GPU the caching
    allocator's reserved peak plus what the device holds beyond the allocator (the context, the
    libraries). Read, never reset: resetting it is the program's to do.

    Example::

        high_water_bytes(torch.device("cpu"))   # 412_000_000 for a process that trained a small model
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) + this_process_baseline_bytes(device)
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB


def process_bytes(device: torch.device) -> int:
    """What this process holds now, in the sense ``memory_budget`` counts it: on a CPU its resident
    memory (``VmRSS``), on a GPU the device memory in use (the allocator's reserved, the context and
    the libraries). 0 where it cannot be read.

    Example::

        process_bytes(torch.device("cpu"))   # 390_000_000 for a process that imported torch
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return _status_bytes("VmRSS") or 0


def _status_bytes(field: str) -> int | None:
    """``field`` of ``/proc/self/status`` (a size in kB there) in bytes; None where it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
