"""What a probe measured, as a record a plan keeps and its JSON carries (see [Note: the probe] in
:mod:`dspark.planner.probe`, which measures it).

Example::

    Probe.from_dict(json.loads(Path("plan.json").read_text())["probe"])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Line", "Probe", "beyond_held_gradients", "fit_line", "interval_lines"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Line:
    """A cost measured at two batch sizes: ``fixed + per_sample * batch``."""

    fixed: float
    per_sample: float

    def at(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """What one device measured (see [Note: the probe])."""

    device: str
    """Where it ran: ``"cpu"`` or ``"cuda:0"``."""
    batches: tuple[int, int]
    """The two local batch sizes measured."""
    forward_ms: Line
    backward_ms: Line
    optimizer_ms: float
    """One optimizer step over every parameter (it does not depend on the batch)."""
    step_bytes: Line
    """The step's tensor peak beyond one device's model state, by batch (activations + runtime)."""
    grad_ready: tuple[float, ...]
    """Per trainable parameter (in ``model.parameters()`` order, tied ones once): the fraction of
    backward after which its gradient is complete."""
    unit_forward_share: tuple[float, ...]
    """Per zero3 unit (the engine's default units, root first): its share of the forward time."""
    optimizer_state: tuple[int, bool]
    """:func:`dspark.policy.state_bytes.optimizer_state_elements` of the optimizer after a step."""
    optimizer_fixed_ms: float = 0.0
    """The part of ``optimizer_ms`` that does not shrink with the rows stepped (a kernel launch and
    the bookkeeping per parameter tensor): a step over ``1/N`` of every parameter's rows takes
    ``optimizer_fixed_ms + (optimizer_ms - optimizer_fixed_ms) / N``. Measured from a second step over
    a quarter of every parameter; 0.0: not measured (the step then scales by ``1/N`` whole)."""
    copy_bytes_per_s: float = 0.0
    """Bytes per second one copy between two buffers of this device moves; 0.0: not measured (the
    engine's copies then cost nothing in the plan)."""
    per_copy_s: float = 0.0
    """Seconds of one small copy into a view of a flat buffer, beyond its bytes (the engine makes one
    per parameter, see [Note: per-copy cost] in :mod:`dspark.planner.copy_probe`); 0.0: not measured
    (an older plan's JSON: the copies then cost their bytes only)."""
    check_bytes_per_s: float = 0.0
    """Bytes per second of the engine's pass over the reduced gradients that scales them and flags a
    value that is not finite (PyTorch's fused check-and-unscale kernel, see [Note: non-finite
    gradients found in the reduction] in :mod:`dspark.engine.finite_check`); 0.0: not measured (the
    pass then costs nothing in the plan)."""
    grad_events: tuple[int, ...] = ()
    """The trainable parameter (index, as in ``grad_ready``) of each gradient accumulation of one
    backward, in order; a parameter used twice (a tied head) appears twice. Empty: not measured."""
    interval_bytes: tuple[Line, ...] = ()
    """By batch, the step's tensor bytes at their highest in each interval of the step: the model's
    forward, the loss (beyond the model's forward), backward to the first accumulation of
    ``grad_events``, between two accumulations, from the last to the end of backward, and the
    optimizer step; beyond one device's
    parameters and optimizer state and beyond the gradients
    accumulated so far: what a rank holds besides what its strategy makes it hold (see [Note: the
    step's timeline] in :mod:`dspark.planner.peak_timeline`). Empty: not measured."""
    process_baseline_bytes: int = 0
    """What a rank's process holds besides its tensors: on a CPU the libraries' resident memory (a
    fresh process's, or with ``baseline_in_rank`` this rank's own), on a GPU the CUDA context; 0:
    not measured (no process peak is predicted). See [Note: process memory]."""
    baseline_in_rank: bool = False
    """``process_baseline_bytes`` was read in a rank of the world that will train (``strategy='auto'``):
    it holds what a rank of several holds already."""
    allocator_share: float = 0.0
    """The allocator's memory beyond the live tensors, as a share of the tensor peak (see
    [Note: process memory])."""
    timing_rounds: int = 1
    """Rounds the step was timed in (see [Note: steady steps] in :mod:`dspark.planner.probe_timing`)."""
    steady: bool = True
    """Whether the rounds kept were within ``STEADY_SPREAD`` of each other (False: a busy machine)."""
    step_spread: float = 0.0
    """Range over median of the kept rounds' steps at the larger batch."""
    forward_ms_rounds: tuple[Line, ...] = ()
    """Each kept round's own forward line (the rows' intervals come from them); empty: one value."""
    backward_ms_rounds: tuple[Line, ...] = ()
    optimizer_ms_rounds: tuple[float, ...] = ()
    refused_fits: tuple[str, ...] = ()
    """Parts (``"forward"``, ``"backward"``) whose fit implied more than linear speed-up and were
    taken as proportional to the batch instead."""
    accumulation_bytes: tuple[Line, ...] = ()
    """The same bytes at the end of the model's forward and of the loss, at the instant of each
    accumulation of ``grad_events``
    (the new gradient among them: where the engine allocates its buckets) and at the end of
    backward."""
    loss_backward_bytes: Line | None = None
    """The same bytes at their highest in the loss's own backward, from the loss's mark until the
    gradient reaches the model's output (a language model's logits and their gradients), where
    zero3 holds no unit gathered; ``interval_bytes``' third interval then starts at the model's
    output. None: not measured (the third interval includes it)."""
    fault_bytes_per_s: float = 0.0
    """Bytes per second that the first touch of memory the C library maps afresh runs at (a page
    fault per page: what a CPU allocation above the mmap threshold costs each time it is made, see
    [Note: why the thresholds] in :mod:`dspark.cpu_malloc`); 0.0: not measured, or not a CPU."""
    heap_step_bytes: Line | None = None
    """By batch, the most bytes a step's transients held at once in allocations smaller than
    :func:`dspark.cpu_malloc.mmap_threshold_bytes` (beyond the gradients of that size), which the C
    library serves from its heap; the larger ones (a language model's logits) it maps apart and
    unmaps when freed. What the heap keeps beyond the live tensors follows this high-water, not the
    step's peak (see [Note: process memory]). None: not measured (a GPU, a fake trace, an older
    plan's JSON: every transient at the peak counts as in the heap)."""
    frozen_unread: tuple[int, ...] = ()
    """Frozen parameters (indices in ``model.parameters()`` order of the frozen ones, tied ones once)
    that nothing saved for backward: zero3 does not regather them for backward (see [Note: frozen
    parameters in backward] in :mod:`dspark.engine.zero3_units`). Empty: every one is read."""

    def activation_bytes(self, batch: float) -> int:
        """Bytes of a step's activations at ``batch`` (without the runtime's fixed part)."""
        return max(0, round(self.step_bytes.at(batch) - self.runtime_bytes()))

    def runtime_bytes(self) -> int:
        """The fixed part of a step's memory beyond model state (does not shrink with the batch)."""
        return max(0, round(self.step_bytes.fixed))

    @classmethod
    def from_one_step(cls, *, device: str, batch: int, forward_ms: float, backward_ms: float,
                      optimizer_ms: float, step_bytes: float, num_params: int,
                      unit_bytes: Sequence[int], optimizer_state: tuple[int, bool] = (2, True)) -> Probe:
        """A probe from one measured step at ``batch`` samples (a lab result on one device) instead
        of a run: each cost taken as proportional to the batch (no fixed part is known from one
        point), gradients ready evenly through backward in reverse parameter order, each unit's
        share of forward proportional to its parameter bytes (``unit_bytes``, root first).

        Example::

            Probe.from_one_step(device="cpu", batch=32, forward_ms=150.0, backward_ms=300.0,
                                optimizer_ms=20.0, step_bytes=250e6, num_params=52, unit_bytes=[1, 4])
        """
        if batch < 1 or num_params < 0:
            raise ValueError(f"batch={batch!r} must be >= 1 and num_params={num_params!r} >= 0")
        total = sum(unit_bytes) or 1
        return cls(device=device, batches=(batch, batch),
                   forward_ms=Line(fixed=0.0, per_sample=forward_ms / batch),
                   backward_ms=Line(fixed=0.0, per_sample=backward_ms / batch),
                   optimizer_ms=optimizer_ms, step_bytes=Line(fixed=0.0, per_sample=step_bytes / batch),
                   grad_ready=tuple((num_params - i) / num_params for i in range(num_params)),
                   unit_forward_share=tuple(b / total for b in unit_bytes),
                   optimizer_state=optimizer_state)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Probe:
        """The probe ``dataclasses.asdict`` wrote (a plan's JSON keeps it under ``"probe"``), to plan
        again from the same measurement on another machine or with other settings.

        Example::

            Probe.from_dict(json.loads(Path("plan.json").read_text())["probe"])
        """
        try:
            return cls(device=str(data["device"]), batches=tuple(data["batches"]),  # type: ignore[arg-type]
                       forward_ms=Line(**data["forward_ms"]), backward_ms=Line(**data["backward_ms"]),
                       optimizer_ms=float(data["optimizer_ms"]), step_bytes=Line(**data["step_bytes"]),
                       grad_ready=tuple(map(float, data["grad_ready"])),
                       unit_forward_share=tuple(map(float, data["unit_forward_share"])),
                       optimizer_state=(int(data["optimizer_state"][0]), bool(data["optimizer_state"][1])),
                       copy_bytes_per_s=float(data.get("copy_bytes_per_s", 0.0)),
                       per_copy_s=float(data.get("per_copy_s", 0.0)),
                       check_bytes_per_s=float(data.get("check_bytes_per_s", 0.0)),
                       optimizer_fixed_ms=float(data.get("optimizer_fixed_ms", 0.0)),
                       grad_events=tuple(map(int, data.get("grad_events", ()))),
                       interval_bytes=tuple(Line(**line) for line in data.get("interval_bytes", ())),
                       accumulation_bytes=tuple(Line(**line) for line in data.get("accumulation_bytes", ())),
                       process_baseline_bytes=int(data.get("process_baseline_bytes", 0)),
                       baseline_in_rank=bool(data.get("baseline_in_rank", False)),
                       allocator_share=float(data.get("allocator_share", 0.0)),
                       timing_rounds=int(data.get("timing_rounds", 1)), steady=bool(data.get("steady", True)),
                       step_spread=float(data.get("step_spread", 0.0)),
                       forward_ms_rounds=tuple(Line(**line) for line in data.get("forward_ms_rounds", ())),
                       backward_ms_rounds=tuple(Line(**line) for line in data.get("backward_ms_rounds", ())),
                       optimizer_ms_rounds=tuple(map(float, data.get("optimizer_ms_rounds", ()))),
                       refused_fits=tuple(map(str, data.get("refused_fits", ()))),
                       fault_bytes_per_s=float(data.get("fault_bytes_per_s", 0.0)),
                       frozen_unread=tuple(map(int, data.get("frozen_unread", ()))),
                       loss_backward_bytes=Line(**data["loss_backward_bytes"])
                       if data.get("loss_backward_bytes") else None,
                       heap_step_bytes=Line(**data["heap_step_bytes"])
                       if data.get("heap_step_bytes") else None)
        except (KeyError, TypeError, IndexError) as exc:
            raise ValueError(f"not a probe written by dspark.plan: {exc!r} (keys: {sorted(data)})") from None


def beyond_held_gradients(peaks: Sequence[int], events: Sequence[int], grad_bytes: Sequence[int],
                          held_bytes: int) -> list[float]:
    """Each interval's peak (:func:`~dspark.planner.peak_memory.measure_interval_peaks`, one interval
    per mark in ``events``, the parameter accumulated there or -1, and one more) less ``held_bytes``
    (what the step held throughout) and less the gradients one process holds by then (those of the
    parameters accumulated at an earlier mark: ``grad_bytes`` by parameter)."""
    out, seen, grads = [], set(), 0
    for k, peak in enumerate(peaks):
        out.append(float(peak - held_bytes - grads))
        if k < len(events) and events[k] >= 0 and events[k] not in seen:
            seen.add(events[k])
            grads += grad_bytes[events[k]]
    return out


OUTPUT_GRAD = -2
"""The probe's mark where the gradient reaches the model's output (see ``Probe.loss_backward_bytes``)."""


def split_loss_backward(by_interval: list[float], levels: list[float],
                        events: Sequence[int]) -> tuple[list[float], list[float], float | None]:
    """The intervals and mark levels without the :data:`OUTPUT_GRAD` mark, and the loss's own
    backward's bytes (the interval that mark ends); None where it did not fire (no output needs a
    gradient).

    Example::

        split_loss_backward([5.0, 9.0, 7.0, 3.0], [4.0, 6.0, 2.0], [-1, -2, -1])   # ([5, 7, 3], [4, 2], 9)
    """
    if OUTPUT_GRAD not in events:
        return by_interval, levels, None
    at = list(events).index(OUTPUT_GRAD)
    return by_interval[:at] + by_interval[at + 1:], levels[:at] + levels[at + 1:], by_interval[at]


def interval_lines(measured: Sequence[tuple[int, tuple[int, ...], list[float], list[float], float | None]]
                   ) -> dict[str, Any]:
    """``grad_events``, ``interval_bytes`` and ``accumulation_bytes`` of a :class:`Probe` from
    ``(batch, events, bytes by interval, bytes at each accumulation, the loss's own backward's bytes or
    None)`` at each batch size (and ``loss_backward_bytes``); none where
    the batch sizes saw different accumulations (a graph that changes with the batch: the planner
    then holds every interval to ``step_bytes``)."""
    if not measured or len({m[1] for m in measured}) != 1 or any(
            len(m[2]) != len(m[1]) + 4 or len(m[3]) != len(m[1]) + 3 for m in measured):
        return {}
    (b0, events, first, first_at, loss0), (b1, _, last, last_at, loss1) = measured[0], measured[-1]
    loss_backward = fit_line([(b0, loss0), (b1, loss1)]) if loss0 is not None and loss1 is not None else None
    return {"grad_events": events, "loss_backward_bytes": loss_backward,
            "interval_bytes": tuple(fit_line([(b0, y0), (b1, y1)]) for y0, y1 in zip(first, last, strict=True)),
            "accumulation_bytes": tuple(fit_line([(b0, y0), (b1, y1)])
                                        for y0, y1 in zip(first_at, last_at, strict=True))}


def fit_line(points: Sequence[tuple[int, float]]) -> Line:
    (b0, y0), (b1, y1) = points
    per_sample = (y1 - y0) / (b1 - b0) if b1 != b0 else y1 / max(b1, 1)
    return Line(fixed=y1 - per_sample * b1, per_sample=per_sample)


