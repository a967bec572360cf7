"""One short run on one device: what a training step of the model costs there, part by part.

[Note: the probe] The planner measures once, on this process's device, with plain PyTorch (no
process group, no engine: what every strategy shares): a copy of the model (the caller's weights
are never stepped), forward under the precision's autocast, backward, the optimizer step; at two
local batch sizes, so that each cost is a line ``fixed + per_sample * batch``:

* forward, backward and optimizer milliseconds (median over ``steps`` steps after one warm-up);
* the tensor peak of one step (:func:`dspark.planner.peak_memory.measure_peak_bytes`) less the model
  state one device holds (parameters, whole gradients, optimizer state) and less the caller's own
  parameters and buffers where they sit on the same device (held while the copy runs, absent from a
  real run): the step's *activations* (at the batch) and the *runtime* (the fixed part: scratch that
  does not shrink with the batch);
* on a CPU, the most bytes the step's allocations below the C library's mmap threshold held at
  once, beyond the gradients of that size: what of the step lives in the heap (see [Note: process
  memory]);
* when, in backward, each parameter's gradient is complete (a fraction of the backward time):
  where each gradient bucket becomes ready, for the overlap of its reduction with backward;
* each top-level unit's share of the forward time, for zero3's gathers ahead of use;
* the device's copy bandwidth over a buffer the size of the gradients (at most ``_COPY_MAX_BYTES``): the engine
  packs send buffers and lands gathered rows with such copies (see [Note: what each strategy sends]).

On a CPU the probe first sets malloc as the engine will (:func:`dspark.cpu_malloc.tune_for_training`):
glibc's own thresholds move with what the process frees, and a short run paid page faults there.

A model built on the meta device is materialised on this device first (``reset_parameters()``, as
the engine does): the probe needs real numbers to run. That needs its one-device state in memory;
the planner says so and stops where it would not fit (see :func:`dspark.plan`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dspark.cpu_malloc import advise_huge_pages, mmap_threshold_bytes, tune_for_training
from dspark.meta.materialize import has_meta_tensors, materialize
from dspark.planner.copy_probe import measure_per_copy_s, median_pass_s
from dspark.planner.peak_memory import PeakMarks, measure_interval_peaks
from dspark.planner.probe_record import (
    OUTPUT_GRAD,
    Line,
    Probe,
    beyond_held_gradients,
    fit_line,
    interval_lines,
    split_loss_backward,
)
from dspark.planner.probe_timing import time_rounds
from dspark.planner.process_memory import process_terms
from dspark.policy.optimizer_kernel import prefer_fused_kernel
from dspark.policy.state_bytes import expected_state_bytes, optimizer_state_elements
from dspark.policy.strategies import STRATEGIES, precision_policy
from dspark.tensor.storage import storage_bytes

__all__ = ["Line", "LossFn", "Probe", "batch_size", "loss_of", "measure_check_bytes_per_s", "measure_copy_bytes_per_s",
           "measure_fault_bytes_per_s", "measure_probe", "optimizer_state_of", "slice_batch"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, targets) -> loss`` for a batch ``(inputs, targets)``."""


def _leading(x: Any) -> int | None:
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() > 0 else None


def batch_size(batch: Any) -> int:
    """The leading size shared by every tensor in ``batch`` (tensor, tuple, list or dict).

    Example::

        batch_size((torch.zeros(8, 3), torch.zeros(8)))   # 8
    """
    sizes: set[int] = set()
    tree_map(lambda x: sizes.add(n) if (n := _leading(x)) is not None else None, batch)
    if len(sizes) != 1:
        raise ValueError(f"sample_batch: its tensors' leading sizes are {sorted(sizes)}; the planner "
                         "needs one batch dimension shared by every tensor (dim 0)")
    return sizes.pop()


def slice_batch(batch: Any, rows: int) -> Any:
    """The first ``rows`` samples of every tensor in ``batch``, repeated when ``rows`` exceeds it.

    Example::

        slice_batch((torch.zeros(8, 3), torch.zeros(8)), 2)   # shapes (2, 3) and (2,)
    """
    def take(x: Any) -> Any:
        if _leading(x) is None:
            return x
        reps = -(-rows // x.shape[0])
        whole = x.repeat(reps, *([1] * (x.dim() - 1))) if reps > 1 else x
        return whole[:rows].clone()
    return tree_map(take, batch)


def _to(batch: Any, device: torch.device) -> Any:
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def loss_of(model: Callable[..., Any], batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """The loss of one forward of ``model`` on ``batch``: ``loss_fn(model(inputs), targets)`` for a
    batch ``(inputs, targets)``, else what the model returns (its ``.loss`` for HuggingFace models)."""
    if loss_fn is not None:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError("sample_batch must be (inputs, targets) when loss_fn is given; got "
                             f"{type(batch).__name__}")
        inputs, targets = batch
        return loss_fn(model(inputs), targets)
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    loss = getattr(out, "loss", out)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ValueError("without loss_fn the model must return a 0-d loss (or an output with .loss, "
                         "as HuggingFace models do with labels); pass loss_fn(output, targets)")
    return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Runner:
    """The probe's model copy, optimizer and timing hooks."""

    def __init__(self, model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                 precision: str, device: torch.device, units: Sequence[nn.Module]) -> None:
        self.model, self.device = model, device
        params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
        self.params = params
        self.optimizer = optimizer(params)
        prefer_fused_kernel(self.optimizer)  # the kernel the engine picks: no foreach scratch
        dtype = precision_policy(precision).compute_dtype
        self.autocast: Callable[[], Any] = (
            (lambda: torch.autocast(device.type, dtype=dtype)) if dtype is not None
            else contextlib.nullcontext)
        self.ready: dict[int, float] = {}
        self.events: list[int] = []  # per mark: the parameter accumulated, or -1 (forward/backward ends)
        # on a CPU, what of the step the C library's heap serves (see [Note: process memory])
        self.marks = PeakMarks(device, large_from_bytes=mmap_threshold_bytes() if device.type == "cpu" else None)
        self.unit_times: list[tuple[int, float, float]] = []
        self._started: dict[int, float] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad(i)) for i, p in enumerate(params)]
        self._hooks += [u.register_forward_pre_hook(self._on_unit(i, start=True)) for i, u in enumerate(units)]
        self._hooks += [u.register_forward_hook(self._on_unit(i, start=False)) for i, u in enumerate(units)]

    def _on_grad(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.ready[index] = time.perf_counter()
            self.events.append(index)
            self.marks.mark()
        return hook

    def _on_unit(self, index: int, *, start: bool) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            now = time.perf_counter()
            if start:
                self._started[index] = now
            elif index in self._started:
                self.unit_times.append((index, self._started.pop(index), now))
        return hook

    def _phase_mark(self) -> None:
        self.events.append(-1)
        self.marks.mark()

    def _forward_then_mark(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        self._phase_mark()  # the model's forward ends
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        fired = [False]

        def output_grad(_: torch.Tensor) -> None:
            if not fired[0]:  # the loss's own backward ends (see Probe.loss_backward_bytes)
                fired[0] = True
                self.events.append(OUTPUT_GRAD)
                self.marks.mark()
        for t in outputs:
            t.register_hook(output_grad)
        return out

    def step(self, batch: Any, loss_fn: LossFn | None) -> tuple[float, float, float, float]:
        """One step: ``(forward_s, backward_s, optimizer_s, backward_start)``."""
        self.ready.clear()
        self.events.clear()
        self.unit_times.clear()
        _sync(self.device)
        t0 = time.perf_counter()
        with self.autocast():
            loss = loss_of(self._forward_then_mark, batch, loss_fn)
        _sync(self.device)
        t1 = time.perf_counter()
        self._phase_mark()  # the loss is computed (see Probe.interval_bytes)
        loss.backward()
        _sync(self.device)
        t2 = time.perf_counter()
        self._phase_mark()  # backward ends: the optimizer step is an interval of its own
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        t3 = time.perf_counter()
        self.forward_span = (t0, t1)
        return t1 - t0, t2 - t1, t3 - t2, t1

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def measure_probe(model: nn.Module, sample_batch: Any, *, loss_fn: LossFn | None,
                  optimizer: Callable[..., torch.optim.Optimizer], precision: str,
                  device: torch.device, batches: tuple[int, int], units: Sequence[str],
                  steps: int = 3, library_baseline: bool = True) -> Probe:
    """Measure ``model`` on ``device`` at the two local batch sizes ``batches`` (see
    [Note: the probe]). ``units`` names the zero3 units (root first, ``""``). ``library_baseline``:
    measure a fresh process's libraries on a CPU (see [Note: process memory]; False where the caller
    reads the baseline in the process that will train).

    Example::

        measure_probe(model, (x, y), loss_fn=F.cross_entropy, optimizer=torch.optim.AdamW,
                      precision="fp32", device=torch.device("cpu"), batches=(2, 8), units=[""])
    """
    if steps < 1:
        raise ValueError(f"steps={steps!r} must be >= 1")
    if device.type == "cpu":  # the step timed as the engine runs it: see [Note: the probe]
        tune_for_training()
    # the caller's own tensors on this device are held while the copy runs, but a trained model has
    # only one set: not part of the step's peak (they were, as the fixed part: a constant excess)
    caller_bytes = storage_bytes([*model.parameters(), *model.buffers()], device_type=device.type)
    work = copy.deepcopy(model)
    if has_meta_tensors(work):
        materialize(work, device, lambda name, p: None)
    work.to(device).train()
    modules = dict(work.named_modules())
    runner = _Runner(work, optimizer, precision, device, [modules[name] for name in units])
    peaks: list[tuple[int, float]] = []
    heap: list[tuple[int, float]] = []  # the heap's high-water of each step's transients
    intervals: list[tuple[int, tuple[int, ...], list[float], list[float], float | None]] = []
    ready: list[float] = [1.0] * len(runner.params)
    shares: list[float] = [0.0] * len(units)
    state: tuple[int, bool] = (0, False)
    state_bytes = 0
    prepared = {rows: _to(slice_batch(sample_batch, rows), device) for rows in dict.fromkeys(batches)}
    frozen = [p for p in dict.fromkeys(work.parameters()) if not p.requires_grad]
    saved: set[tuple[int, torch.dtype]] = set()
    try:
        for rows, batch in prepared.items():
            with _recording_saved(saved):  # warm-up: kernels chosen, optimizer state allocated
                runner.step(batch, loss_fn)
            state = optimizer_state_elements(runner.optimizer)
            state_bytes = _one_device_state_bytes(work, runner.params, state)
            _, b_s, _, b_start = runner.step(batch, loss_fn)
            ready = [min(1.0, max(0.0, (runner.ready.get(i, b_start + b_s) - b_start) / b_s))
                     for i in range(len(runner.params))]
            shares = _unit_shares(runner.unit_times, len(units), runner.forward_span)
            by_interval = measure_interval_peaks(functools.partial(runner.step, batch, loss_fn), device,
                                                 runner.marks)
            peaks.append((rows, float(max(by_interval) - state_bytes - caller_bytes)))
            grad_bytes = [p.numel() * p.element_size() for p in runner.params]
            if runner.marks.small_peak_bytes is not None:  # the step's own, beyond the gradients kept
                heap.append((rows, float(max(0, runner.marks.small_peak_bytes - sum(
                    g for g in grad_bytes if g < mmap_threshold_bytes())))))
            held = state_bytes - sum(grad_bytes) + caller_bytes
            intervals.append((rows, tuple(e for e in runner.events if e >= 0), *split_loss_backward(
                beyond_held_gradients(by_interval, runner.events, grad_bytes, held),
                beyond_held_gradients(runner.marks.levels, runner.events, grad_bytes, held), runner.events)))
        timing = time_rounds(lambda rows: runner.step(prepared[rows], loss_fn)[:3], batches, ROUND_STEPS,
                             before_round=_weights_restored(runner.params))
    finally:
        runner.close()
    if len(peaks) == 1:  # one batch size given twice
        peaks.append(peaks[0])
        intervals.append(intervals[0])
        heap *= 2
    grad_bytes_total = sum(p.numel() * p.element_size() for p in runner.params)
    quarter_ms = _quarter_optimizer_ms(runner.params, optimizer, device, steps)
    # full = fixed + per_row_share, quarter = fixed + per_row_share / 4
    optimizer_fixed_ms = min(timing.optimizer_ms, max(0.0, (4 * quarter_ms - timing.optimizer_ms) / 3))
    return Probe(device=str(device), batches=batches, forward_ms=timing.forward_ms, backward_ms=timing.backward_ms,
                 optimizer_ms=timing.optimizer_ms, step_bytes=fit_line(peaks),
                 grad_ready=tuple(ready), unit_forward_share=tuple(shares), optimizer_state=state,
                 optimizer_fixed_ms=optimizer_fixed_ms,
                 copy_bytes_per_s=measure_copy_bytes_per_s(device, min(grad_bytes_total, _COPY_MAX_BYTES)),
                 per_copy_s=measure_per_copy_s(device),
                 check_bytes_per_s=measure_check_bytes_per_s(device, min(grad_bytes_total, _COPY_MAX_BYTES)),
                 fault_bytes_per_s=measure_fault_bytes_per_s(device),
                 frozen_unread=tuple(i for i, p in enumerate(frozen)
                                     if (p.untyped_storage().data_ptr(), p.dtype) not in saved),
                 timing_rounds=timing.rounds, steady=timing.steady, step_spread=timing.spread,
                 forward_ms_rounds=timing.forward_ms_rounds, backward_ms_rounds=timing.backward_ms_rounds,
                 optimizer_ms_rounds=timing.optimizer_ms_rounds, refused_fits=timing.refused_fits,
                 heap_step_bytes=fit_line(heap) if len(heap) == 2 else None,
                 **interval_lines(intervals), **process_terms(model, device, library_baseline))


_COPY_MAX_BYTES = 64 << 20
ROUND_STEPS = 2
"""Steps at each batch size in one timing round (see [Note: steady steps]): rounds, not steps
within one, are what the probe repeats until steady."""


def _quarter_optimizer_ms(params: Sequence[torch.Tensor], optimizer: Callable[..., torch.optim.Optimizer],
                          device: torch.device, steps: int) -> float:
    """Milliseconds of one optimizer step over a quarter of every parameter's elements (the same
    tensor count, as a rank of a sharded strategy steps its rows), median of ``steps`` after one."""
    quarters = [nn.Parameter(torch.zeros(-(-p.numel() // 4), dtype=p.dtype, device=device)) for p in params]
    for q in quarters:
        q.grad = torch.full_like(q, 1e-3)
    opt = optimizer(quarters)
    prefer_fused_kernel(opt)
    opt.step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _weights_restored(params: Sequence[torch.Tensor]) -> Callable[[], None]:
    """What puts ``params`` back to their values now, for each timing round to start from (see
    [Note: each round starts from the same weights])."""
    start = [p.detach().clone() for p in params]

    def restore() -> None:
        with torch.no_grad():
            for p, value in zip(params, start, strict=True):
                p.copy_(value)
    return restore


# [Note: each round starts from the same weights] The probe trains its copy of the model on one
# batch, in rounds of steps at two sizes until steady. Left to train on, a model memorises that
# batch: its softmax's smallest probabilities, their gradients and the optimizer's moments fall
# below float32's normal range, and x86 arithmetic on denormal floats is many times slower. A
# tied-embedding model's backward grew round by round to twenty times its first step's, so the probe
# never became steady and predicted its step several times what the run takes. Each round now starts
# from the weights the probe's first steps reached, so no round trains further into the batch than
# the first did. Flushing denormals to zero in the probe's steps (what the probe did before) hid the
# memorising, but also the denormals a real run meets on every step (a deep MLP's optimizer moments
# after a few steps): the engine pays those, and the probe timed every model about a sixth fast on
# one rank (docs/figures.md#2026-12-07-2vcpu-plan-validation-zoo-quiet3).


@contextlib.contextmanager
def _recording_saved(saved: set[tuple[int, torch.dtype]]) -> Iterator[None]:
    """Record the storage and dtype of every tensor autograd saves for backward meanwhile (what
    backward reads: see [Note: frozen parameters in backward] in :mod:`dspark.engine.zero3_units`)."""
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta" and not tensor.is_sparse:
            saved.add((tensor.untyped_storage().data_ptr(), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


FAULT_PROBE_MARGIN_BYTES = 4 << 20
"""How far past the size the C library maps apart :func:`measure_fault_bytes_per_s`'s buffer is."""


def measure_fault_bytes_per_s(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second of a first touch of ``nbytes`` the C library maps afresh (one page fault per
    page, see [Note: why the thresholds] in :mod:`dspark.cpu_malloc`), advised to huge pages as the
    engine's gathered storages are ([Note: huge pages for mapped storages]): a fresh tensor's
    allocation and first fill less its second fill, medians of ``repeats``; 0.0 off the CPU or when
    the first fill is no slower (an allocator that keeps the memory: nothing to pay). ``nbytes``
    defaults to just past the size the C library maps apart
    (:func:`dspark.cpu_malloc.mmap_threshold_bytes`), and one buffer is held at a time: the probe
    runs in the rank that will train, and what it holds counts against the rank's ``memory_budget``
    like the training's own peak.

    Example::

        measure_fault_bytes_per_s(torch.device("cpu"))
    """
    if device.type != "cpu":
        return 0.0
    numel = (nbytes if nbytes is not None else mmap_threshold_bytes() + FAULT_PROBE_MARGIN_BYTES) // 4
    fresh_s, kept_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer = torch.empty(numel, dtype=torch.float32)
        advise_huge_pages(buffer.data_ptr(), 4 * numel)  # as zero3's gathered storages are
        buffer.fill_(1.0)
        touched = time.perf_counter()
        buffer.fill_(1.0)
        fresh_s.append(touched - start)
        kept_s.append(time.perf_counter() - touched)
        del buffer  # mapped apart, so unmapped: the next one faults afresh
    fresh, kept = statistics.median(fresh_s), statistics.median(kept_s)
    return 4 * numel / (fresh - kept) if fresh > kept else 0.0


def _pass_bytes_per_s(device: torch.device, nbytes: int, repeats: int,
                      prepare: Callable[[int], Callable[[], Any]]) -> float:
    """Bytes per second of the pass ``prepare(numel)`` returns over ``nbytes`` of float32 (median of ``repeats``)."""
    numel = nbytes // 4
    if numel < 1:
        return 0.0
    return 4 * numel / max(median_pass_s(device, prepare(numel), repeats), 1e-9)


def measure_copy_bytes_per_s(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one copy of ``nbytes`` between two buffers already allocated on
    ``device`` (the median of ``repeats`` after a warm-up; 0.0 for nothing to copy).

    Example::

        measure_copy_bytes_per_s(torch.device("cpu"), 16 << 20)
    """
    def prepare(numel: int) -> Callable[[], Any]:
        src = torch.ones(numel, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    return _pass_bytes_per_s(device, nbytes, repeats, prepare)


def measure_check_bytes_per_s(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of the engine's scale-and-check pass (PyTorch's fused check-and-unscale
    kernel, by one half as on two ranks) over ``nbytes`` of float32 gradients in one flat buffer.

    Example::

        measure_check_bytes_per_s(torch.device("cpu"), 16 << 20)
    """
    def prepare(numel: int) -> Callable[[], Any]:
        grads = torch.ones(numel, dtype=torch.float32, device=device)
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        factor = torch.full((1,), 0.5, dtype=torch.float32, device=device)
        return lambda: torch._amp_foreach_non_finite_check_and_unscale_([grads], found_inf, factor)
    return _pass_bytes_per_s(device, nbytes, repeats, prepare)


def optimizer_state_of(factory: Callable[..., torch.optim.Optimizer]) -> tuple[int, bool]:
    """:func:`dspark.policy.state_bytes.optimizer_state_elements` of what ``factory`` builds, read from
    one built over a meta parameter (no memory, no step); ``(0, False)`` for an optimizer that cannot
    be built on meta (its state is then counted from its first step, where a step runs).

    Example::

        optimizer_state_of(torch.optim.AdamW)   # (2, True)
    """
    param = nn.Parameter(torch.empty(2, device="meta"))
    try:
        return optimizer_state_elements(factory([param]))
    except Exception:
        return 0, False


def _one_device_state_bytes(model: nn.Module, trainable: Sequence[torch.Tensor],
                            optimizer_state: tuple[int, bool]) -> int:
    """Parameters (frozen ones too), whole gradients and optimizer state on one device."""
    state = expected_state_bytes(trainable, STRATEGIES["replicate"], rank=0, num_ranks=1,
                                 optimizer_state=optimizer_state)
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    return sum(state.values()) + sum(p.numel() * p.element_size() for p in frozen.values())


def _unit_shares(times: list[tuple[int, float, float]], count: int,
                 span: tuple[float, float]) -> list[float]:
    """Each unit's share of the forward time: from its pre-hook to its post-hook (the outermost
    call when units nest); the root (unit 0) gets what no other unit ran."""
    t0, t1 = span
    total = max(t1 - t0, 1e-9)
    shares = [0.0] * count
    covered: list[tuple[float, float]] = []
    for index, start, end in sorted(times, key=lambda t: t[1]):
        if index == 0 or any(a <= start and end <= b for a, b in covered):
            continue  # nested in a unit already counted: its time is in that unit's share
        shares[index] += (end - start) / total
        covered.append((start, end))
    if count:
        shares[0] = max(0.0, 1.0 - sum(shares[1:]))
    return shares
