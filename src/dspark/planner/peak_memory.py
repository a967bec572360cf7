"""Peak memory of one training step on one rank, measured rather than computed (the planner's
one-device probe and the benchmark lab measure alike).

* **GPU**: PyTorch's caching allocator keeps the peak itself (``torch.cuda.max_memory_allocated``),
  reset just before the measured region.
* **CPU**: there is no allocator peak counter, so two measurements are added up:

  1. the bytes already held when the region starts: every tensor storage on the device that
     Python can reach (found through the garbage collector, which tracks tensor objects), plus the
     ``.grad`` of each leaf, which lives in C++ and has no Python object until it is read; shared
     storages (views, tied weights) count once;
  2. the highest point of the running sum of the allocation and free events the PyTorch profiler
     records (``profile_memory=True``) during the region, in time order.

  The profiler drops the free of a block allocated before it started (it does not know its size),
  so the region runs twice under one profiler session and only the second run is measured: what
  the first run left behind (last step's gradients, say) is then freed with a known size.

[Note: what the CPU figure misses] Tensors that only C++ holds before the region (an autograd
graph kept alive across steps, a backend's internal buffers such as DDP's reducer buckets) are not
in (1); blocks allocated before the profiler started and freed during the second run, and
allocations on threads the profiler does not follow, are not in (2). A training step starts with no
graph alive, and on CPU the autograd engine runs backward on the calling thread, so for a step all
three are small, but not zero. The process's peak resident memory is
recorded beside it by the lab (:mod:`dspark.bench.measure.memory`) and covers everything, PyTorch's
own libraries included.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from dspark.profiler_banner import quiet_banners
from dspark.tensor.storage import storage_bytes

__all__ = ["PeakMarks", "held_tensor_bytes", "measure_interval_peaks", "measure_peak_bytes", "peak_of_running_sum"]

_MEASURED_REGION = "dspark.bench.measured_region"


def peak_of_running_sum(deltas: Iterable[int]) -> int:
    """The highest value the running sum of ``deltas`` reaches, starting from (and at least) 0.

    Example::

        peak_of_running_sum([10, 5, -10, 20, -25])   # 25
    """
    running = 0
    peak = 0
    for delta in deltas:
        running += delta
        peak = max(peak, running)
    return peak


def held_tensor_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of the tensor storages on ``device`` this process can reach from Python right now
    (and the gradients of leaf tensors), each storage counted once.

    Example::

        before = held_tensor_bytes("cpu")
        kept = torch.empty(1_000_000, dtype=torch.uint8)
        held_tensor_bytes("cpu") - before   # 1000000
    """
    device_type = torch.device(device).type
    # type() instead of isinstance(): isinstance reads __class__, which some lazy module proxies
    # answer with a deprecation warning.
    tensors = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]
    grads = [t.grad for t in tensors if t.is_leaf and t.requires_grad and t.grad is not None]
    # a planner's fake trace holds no storage; each real one counts once ([Note: storage bytes])
    return storage_bytes((t for t in [*tensors, *grads] if not issubclass(type(t), FakeTensor)),
                         device_type=device_type)


class PeakMarks:
    """Splits a measured region into intervals: each :meth:`mark` (called from inside the measured
    function, e.g. by a gradient hook) ends one interval and starts the next, so that
    :func:`measure_interval_peaks` reports the peak of each.

    Example::

        marks = PeakMarks(torch.device("cpu"))
        param.register_post_accumulate_grad_hook(lambda p: marks.mark())
        measure_interval_peaks(step, torch.device("cpu"), marks)   # one peak per gradient, and one more
    """

    def __init__(self, device: torch.device | str = "cpu", *, large_from_bytes: int | None = None) -> None:
        self.device = torch.device(device)
        self.large_from_bytes = large_from_bytes
        """On a CPU: the size from which an allocation counts as large; the others' high-water is
        then followed too (``small_peak_bytes``). None: it is not."""
        self.cuda_peaks: list[int] = []
        self.levels: list[int] = []
        """After :func:`measure_interval_peaks`: the bytes held at each mark."""
        self.small_peak_bytes: int | None = None
        """After :func:`measure_interval_peaks` on a CPU with ``large_from_bytes``: the most bytes
        the region's allocations smaller than that held at once (the C library serves those from
        its heap, the others it maps apart: see [Note: process memory] in
        :mod:`dspark.planner.process_memory`); None otherwise."""

    def start(self) -> None:
        """A new run of the region begins (its marks replace the last run's)."""
        self.cuda_peaks = []
        self.levels = []
        self.small_peak_bytes = None

    def mark(self) -> None:
        if self.device.type == "cuda":
            self.cuda_peaks.append(int(torch.cuda.max_memory_allocated(self.device)))
            self.levels.append(int(torch.cuda.memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        from torch.profiler import record_function

        with record_function(_MARK):
            pass


_MARK = "dspark.bench.peak_mark"


def _profiled_interval_peaks(fn: Callable[[], object], device: torch.device, marks: PeakMarks) -> list[int]:
    from torch.profiler import ProfilerActivity, profile, record_function

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_banners():  # see dspark.profiler_banner
        prof.start()
    try:
        marks.start()
        fn()  # priming run: see the module docstring
        gc.collect()
        held_bytes = held_tensor_bytes(device)
        marks.start()
        with record_function(_MEASURED_REGION):
            fn()
    finally:
        with quiet_banners():
            prof.stop()
    # The profiler's public tables attribute memory to operators; the raw event stream is the
    # only place with every allocation and free in time order.
    events: list[Any] = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    region = next(e for e in events if e.name() == _MEASURED_REGION)
    start_ns, end_ns = region.start_ns(), region.end_ns()
    bounds = sorted(e.start_ns() for e in events if e.name() == _MARK and start_ns <= e.start_ns() <= end_ns)
    memory = sorted(
        (event.start_ns(), event.nbytes()) for event in events
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
        and start_ns <= event.start_ns() <= end_ns
    )
    peaks = [0] * (len(bounds) + 1)
    levels = [0] * len(bounds)
    large_from = marks.large_from_bytes if marks.large_from_bytes is not None else math.inf
    running, running_small, small_peak, interval = 0, 0, 0, 0
    for when, nbytes in memory:
        while interval < len(bounds) and when >= bounds[interval]:
            levels[interval] = running
            interval += 1
            peaks[interval] = running  # held when the interval starts
        running += nbytes
        peaks[interval] = max(peaks[interval], running)
        if abs(nbytes) < large_from:  # a free reports the size it frees, negative
            running_small += nbytes
            small_peak = max(small_peak, running_small)
    for later in range(interval, len(bounds)):
        levels[later] = running
        peaks[later + 1] = running
    marks.levels = [held_bytes + max(0, level) for level in levels]
    if marks.large_from_bytes is not None:
        marks.small_peak_bytes = small_peak
    return [held_bytes + max(0, p) for p in peaks]


def measure_interval_peaks(fn: Callable[[], object], device: torch.device | str, marks: PeakMarks) -> list[int]:
    """The most tensor bytes this process held on ``device`` in each interval of ``fn`` between two
    calls of ``marks.mark()`` (one more interval than marks), as :func:`measure_peak_bytes` measures
    the whole: ``fn`` runs once on GPU and twice on CPU. ``marks.levels`` then holds the bytes held
    at each mark.

    Example::

        peaks = measure_interval_peaks(step, torch.device("cpu"), marks)
        max(peaks)   # the step's peak
    """
    device = torch.device(device)
    marks.device = device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        marks.start()
        fn()
        torch.cuda.synchronize(device)
        return [*marks.cuda_peaks, int(torch.cuda.max_memory_allocated(device))]
    if device.type != "cpu":
        raise ValueError(f"device={str(device)!r}: peak memory is measured on 'cpu' or 'cuda' only")
    return _profiled_interval_peaks(fn, device, marks)


def measure_peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The most tensor bytes this process held on ``device`` while ``fn`` ran, including what was
    held before it started. ``fn`` runs once on GPU and twice on CPU (the first run primes the
    profiler), so it must be repeatable, like a training step.

    Example::

        peak = measure_peak_bytes(lambda: train_one_step(), torch.device("cpu"))
    """
    return max(measure_interval_peaks(fn, device, PeakMarks(device)))
