"""``dspark.plan``: every strategy's predicted memory and step on 1 to N devices, from one probe.

Example::

    plan = dspark.plan(model, (inputs, targets), loss_fn=F.cross_entropy, devices=[1, 2, 8],
                       precision="bf16", global_batch=256, interconnect="roce-200g")
    print(plan)            # one row per (strategy, devices): peak by part, step by part, fits
    plan.best(devices=2)   # the fastest row that fits
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dspark.host.cpu_memory import memory_info
from dspark.planner.cost import ModelShape, RowCost, row_cost, state_bytes
from dspark.planner.device_profile import DeviceProfile, get_device_profile, profile_of, scale_probe
from dspark.planner.fake_trace import fake_activation_bytes, fake_probe
from dspark.planner.hybrid_rows import check_shard_group_size, hybrid_group
from dspark.planner.interconnect import Interconnect, get_interconnect
from dspark.planner.probe import LossFn, Probe, batch_size, measure_probe, optimizer_state_of
from dspark.policy.strategies import HYBRID_STRATEGIES, STRATEGIES, all_strategies, precision_policy
from dspark.policy.units import unit_modules

__all__ = ["PEAK_MARGIN", "Plan", "PlanRow", "default_memory_budget", "describe_need", "format_plan",
           "loop_advice", "model_shape", "needed_bytes", "plan", "probe_notes"]

log = logging.getLogger(__name__)

DEFAULT_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=3e-4)
"""What :func:`plan` plans for when given no optimizer: AdamW (two fp32 moments per element)."""
MEMORY_MARGIN = 0.10
"""The default budget keeps this share of the memory free (other processes, the system)."""
PEAK_MARGIN = 0.25
"""A row fits its budget when its predicted process peak (the tensor peak where the process's is
not known) plus this share is within it: the largest shortfall of a predicted process peak on the
validation zoo (docs/figures.md#plan-validation) stays inside it (see :func:`needed_bytes`;
``tests/planner/test_auto_budget.py`` holds it to the newest kept zoo)."""


def describe_need(row: PlanRow) -> str:
    """What ``row`` needs of its budget and why, for an error that names it.

    Example::

        describe_need(row)   # "zero2's ... MB per rank at micro-batch 8 (process peak ... MB, ..."
    """
    process = (f"process peak {_mb(row.process_peak_bytes)}, of which tensors {_mb(row.peak_bytes)}"
               if row.process_peak_bytes is not None else f"tensor peak {_mb(row.peak_bytes)}")
    return (f"{row.strategy}'s {_mb(needed_bytes(row))} per rank at micro-batch {row.micro_batch} "
            f"({process}, plus {PEAK_MARGIN:.0%} for the plan's error)")


def needed_bytes(cost: RowCost) -> int:
    """What a row needs of its budget: its predicted process peak (else its tensor peak) plus
    :data:`PEAK_MARGIN` for the plan's error.

    Example::

        needed_bytes(plan.row("zero3", 2)) <= 8 << 30
    """
    peak = cost.process_peak_bytes if cost.process_peak_bytes is not None else cost.peak_bytes
    return math.ceil(peak * (1 + PEAK_MARGIN))


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRow(RowCost):
    """One strategy on ``devices`` ranks: a rank's predicted peak and step, by part (the byte and
    millisecond fields of :class:`dspark.planner.cost.RowCost`)."""

    strategy: str
    devices: int
    micro_batch: int
    """Samples per forward/backward pass on one rank."""
    passes: int
    """Micro-batches per optimizer step (gradient accumulation)."""
    budget_bytes: int
    """The memory one rank may use here (the plan's ``memory_budget``, or the default)."""
    fits: bool
    """Whether the row's :func:`needed_bytes` (its process peak and the margin) are within
    ``budget_bytes``."""
    shard_group_size: int | None = None
    """A hybrid row's ranks per shard group (``devices / shard_group_size`` groups); None otherwise."""

    @property
    def label(self) -> str:
        """The strategy as the table shows it: a hybrid row with its groups, ``hybrid-zero3 (8x8)``."""
        if self.shard_group_size is None:
            return self.strategy
        return f"{self.strategy} ({self.devices // self.shard_group_size}x{self.shard_group_size})"

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.comm_exposed_ms + self.optimizer_ms

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_ms": self.step_ms}


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Predicted rows for every (strategy, devices), with what they were computed from."""

    rows: tuple[PlanRow, ...]
    global_batch: int
    precision: str
    interconnect: str
    memory_budget_bytes: int | None
    """Per rank; None: each row's device memory less :data:`MEMORY_MARGIN` (see :func:`plan`)."""
    probe: Probe
    probing_peak_bytes: int | None = None
    """``strategy="auto"``: the highest any rank's process went while auto measured this world (its
    link, page-fault and compute probes), where that set a new high for the process; None: not
    measured, or no new high. A budget must hold it as well as the chosen row's need (see [Note:
    auto's own probes and the budget] in :mod:`dspark.planner.auto_choice`)."""

    def best(self, devices: int | None = None) -> PlanRow:
        """The fastest row that fits (on ``devices`` ranks, or the largest count planned); with none
        fitting, ``ValueError`` naming the smallest peak and the budget.

        Example::

            plan.best(devices=2).strategy   # "replicate"
        """
        count = max(r.devices for r in self.rows) if devices is None else devices
        rows = [r for r in self.rows if r.devices == count]
        if not rows:
            raise ValueError(f"devices={devices!r} was not planned; planned: "
                             f"{sorted({r.devices for r in self.rows})}")
        fitting = [r for r in rows if r.fits]
        if not fitting:
            smallest = min(rows, key=needed_bytes)
            raise ValueError(f"no strategy fits on {count} device(s): the smallest need is "
                             f"{describe_need(smallest)}, over the budget of {_mb(smallest.budget_bytes)}; "
                             "add devices or raise memory_budget")
        return min(fitting, key=lambda r: (r.step_ms, list(all_strategies()).index(r.strategy)))

    def row(self, strategy: str, devices: int) -> PlanRow:
        """The row for ``strategy`` on ``devices`` ranks."""
        for r in self.rows:
            if r.strategy == strategy and r.devices == devices:
                return r
        raise ValueError(f"no row for strategy={strategy!r} on devices={devices!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "precision": self.precision,
                "interconnect": self.interconnect, "memory_budget_bytes": self.memory_budget_bytes,
                "probing_peak_bytes": self.probing_peak_bytes,
                "probe": asdict(self.probe), "rows": [r.to_dict() for r in self.rows]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        return format_plan(self)


def _mb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:,.1f} MB"


_COLUMNS = ("strategy", "devices", "micro", "params", "grads", "optim", "activ", "buffers",
            "runtime", "peak MB", "process MB", "compute", "comm", "optim ms", "step ms", "step range",
            "speedup", "fits")


def format_plan(plan: Plan) -> str:
    """``plan`` as a plain-text table (MB = 10**6 bytes; speedup against the 1-device row of the same
    strategy, or the fastest 1-device row when that is missing)."""
    base = {r.strategy: r.step_ms for r in plan.rows if r.devices == 1}
    one = min(base.values()) if base else None
    budget = (_mb(plan.memory_budget_bytes) if plan.memory_budget_bytes is not None else
              "default " + ", ".join(sorted({f"{_mb(r.budget_bytes)} on {r.devices}" for r in plan.rows},
                                            key=lambda t: int(t.rsplit(" ", 1)[1]))))
    batch = (f"global batch {plan.global_batch}" if plan.global_batch else
             "no batch (activations and compute not measured)")
    if plan.probe.device.startswith("fake:"):
        batch += " (activations from a fake trace; compute and optimizer not measured)"
    lines = [f"plan: {batch}, {plan.precision}, interconnect "
             f"{plan.interconnect}, budget per rank {budget}, probe: {plan.probe.device}"]
    lines += probe_notes(plan.probe)
    table = [list(_COLUMNS)]
    for r in plan.rows:
        ref = base.get(r.strategy, one)
        table.append([r.label, str(r.devices), str(r.micro_batch),
                      *(f"{b / 1e6:.1f}" for b in (r.params_bytes, r.grads_bytes, r.optimizer_bytes,
                                                    r.activation_bytes, r.comm_buffer_bytes,
                                                    r.runtime_bytes, r.peak_bytes)),
                      "-" if r.process_peak_bytes is None else f"{r.process_peak_bytes / 1e6:.1f}",
                      *(f"{t:.1f}" for t in (r.compute_ms, r.comm_exposed_ms, r.optimizer_ms, r.step_ms)),
                      "-" if r.step_ms_low is None or r.step_ms_high is None
                      else f"{r.step_ms_low:.1f}-{r.step_ms_high:.1f}",
                      "-" if ref is None or ref <= 0 or r.step_ms <= 0 else f"{ref / r.step_ms:.2f}x",
                      "yes" if r.fits else "NO"])
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    lines.append("memory columns in MB per rank (params, grads, optimizer state; activations, "
                 "communication buffers and runtime scratch at the step's peak); peak: the tensors' "
                 "highest moment; process: the process at that moment, libraries and allocator "
                 f"included; fits: process peak + {PEAK_MARGIN:.0%} within the budget; times in ms per step")
    if plan.probe.device.startswith("fake:"):  # no compute timed: no 1-device step to divide
        lines.append("step ms: the communication alone (a fake trace times no compute); speedup: - "
                     "(measure the probe for one: --trace measure)")
    if any(r.shard_group_size is not None for r in plan.rows):
        lines.append("hybrid-zeroN (R x S): the stage inside shard groups of S ranks, R groups replicating "
                     "it; a rank holds 1/S of what the stage shards")
    shared = [r for r in plan.rows if max(r.co_run_compute_factor, r.co_run_optimizer_factor) > 1]
    if shared:  # see [Note: co-run slowdown] in dspark.planner.co_run
        lines.append("co-run: compute and optim ms include the node's ranks sharing its cache and memory (the "
                     "link probe's measure), compute x / optim x: " + ", ".join(
                         f"{r.label} on {r.devices} x{r.co_run_compute_factor:.2f} / x{r.co_run_optimizer_factor:.2f}"
                         for r in shared))
    split = sorted({(r.passes, r.micro_batch) for r in plan.rows if r.passes > 1 and r.fits})
    for passes, micro in split:
        lines.append(f"micro {micro} x {passes}: " + loop_advice(passes, micro))
    return "\n".join(lines)


def probe_notes(probe: Probe) -> list[str]:
    """How sure the probe's step times are, in lines for the plan's table (see [Note: steady steps]
    in :mod:`dspark.planner.probe_timing`).

    Example::

        probe_notes(plan.probe)   # ["probe: steps timed in 3 rounds, steady (their spread ...) ..."]
    """
    out = []
    if probe.forward_ms_rounds:
        if probe.steady:
            out.append(f"probe: steps timed in {probe.timing_rounds} rounds, steady (their spread "
                       f"{probe.step_spread:.0%}); step range: the rounds' own predictions")
        else:
            out.append(f"probe: steps NOT steady after {probe.timing_rounds} rounds: they spread "
                       f"{probe.step_spread:.0%} (a busy machine?); the step range says how far; re-plan "
                       "on a quiet machine for a firm figure")
    if probe.refused_fits:
        out.append(f"probe: the {' and '.join(probe.refused_fits)} time's fit implied more than linear "
                   "speed-up over ranks: taken as proportional to the batch instead")
    return out


def loop_advice(passes: int, micro_batch: int) -> str:
    """What a training loop does to run a row planned in ``passes`` micro-batches of
    ``micro_batch`` samples per rank: the engine accumulates, the loop splits its batch.

    Example::

        loop_advice(4, 8)   # "Engine(..., grad_accum_steps=4); each step: for xs, ys in ..."
    """
    return (f"Engine(..., grad_accum_steps={passes}); each step, split the rank's batch: "
            f"for xs, ys in zip(x.split({micro_batch}), y.split({micro_batch})): "
            "engine.backward(loss_fn(engine(xs), ys)), then engine.step()")


def default_memory_budget(device: torch.device, local_ranks: int = 1) -> int:
    """Bytes one rank may plan for: the GPU's memory, or on a CPU the host's available memory shared
    by ``local_ranks`` ranks, less :data:`MEMORY_MARGIN`.

    Example::

        default_memory_budget(torch.device("cpu"), local_ranks=2)
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * (1 - MEMORY_MARGIN))
    available = int(memory_info().get("available_bytes") or memory_info().get("total_bytes") or 0)
    return int(available * (1 - MEMORY_MARGIN) / max(1, local_ranks))


def model_shape(model: nn.Module, optimizer_state: tuple[int, bool] = (2, True)) -> ModelShape:
    """What the cost model reads of ``model`` (any device, meta included): its trainable and frozen
    parameters' shapes and dtypes, tied ones once, and which zero3 unit gathers each (the engine's
    default units). ``optimizer_state``: see :func:`dspark.policy.state_bytes.optimizer_state_elements`.

    Example::

        model_shape(torch.nn.Linear(3, 2)).trainable   # (((2, 3), torch.float32), ((2,), torch.float32))
    """
    unique = list(dict.fromkeys(model.parameters()))
    trainable = [p for p in unique if p.requires_grad]
    frozen = [p for p in unique if not p.requires_grad]
    units = unit_modules(model)
    owner: dict[int, int] = {}
    for u, (_, module) in enumerate(units):  # later (deeper) units claim their parameters last
        for p in module.parameters():
            owner[id(p)] = u

    def members(params: list[nn.Parameter]) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in units]
        for i, p in enumerate(params):
            out[owner.get(id(p), 0)].append(i)
        return tuple(tuple(m) for m in out)

    return ModelShape(trainable=tuple((tuple(p.shape), p.dtype) for p in trainable),
                      frozen=tuple((tuple(p.shape), p.dtype) for p in frozen),
                      units=members(trainable), frozen_units=members(frozen), optimizer_state=optimizer_state)


def _micro_batches(local: int, max_micro_batch: int | None) -> list[int]:
    """Equal micro-batches a local batch splits into, largest first (at most ``max_micro_batch``)."""
    sizes = [m for m in range(local, 0, -1) if local % m == 0]
    return [m for m in sizes if max_micro_batch is None or m <= max_micro_batch] or [1]


def plan(model: nn.Module, sample_batch: Any, loss_fn: LossFn | None = None, *,
         optimizer: Callable[..., torch.optim.Optimizer] = DEFAULT_OPTIMIZER,
         devices: Iterable[int] = (1, 2, 8), strategies: str | Sequence[str] = "all",
         precision: str = "fp32", global_batch: int | None = None,
         memory_budget: int | None = None, interconnect: str | Interconnect | None = None,
         bucket_mb: float = 25.0, max_micro_batch: int | None = None,
         device: torch.device | str | None = None, probe: Probe | None = None,
         trace: str = "auto", shard_group_size: int | None = None,
         process_baseline_bytes: int | None = None,
         target_device: str | DeviceProfile | None = None) -> Plan:
    """Predict every strategy's peak memory and step per rank on each device count, from one short
    probe of ``model`` on one device (see :mod:`dspark.planner.probe` and :mod:`dspark.planner.cost`).

    ``sample_batch`` is ``(inputs, targets)`` with ``loss_fn(model(inputs), targets)``, or what the
    model takes when it returns its loss itself; its leading size is the global batch unless
    ``global_batch`` says otherwise. ``memory_budget`` is bytes per rank (default: see
    :func:`default_memory_budget`); a row that does not fit at the whole local batch tries smaller
    equal micro-batches. ``interconnect`` names a profile (:data:`dspark.planner.INTERCONNECTS`) or is
    one; default ``loopback-gloo`` on a CPU, ``nvlink`` on a GPU. ``probe`` reuses an earlier
    measurement. The model may be built on the meta device: the probe materialises a copy.
``trace`` says how a new probe is made: ``"measure"`` runs steps on the device, ``"fake"`` traces
a forward on fake tensors for the activations and measures no time (see [Note: the fake trace]),
``"auto"`` (default) measures unless the one-device model state and the traced activations at the
probe's larger batch would not fit on the device (a model larger than this machine is planned).
    Hybrid rows (``hybrid-zero1/2/3``) split the ranks into shard groups of ``shard_group_size``, by
    default one node of ``interconnect`` (its ``ranks_per_node``); ``strategies="all"`` adds them
    where that makes several groups of several ranks (see :func:`hybrid_group`).

``process_baseline_bytes``: what a rank's process holds besides its tensors, where the caller
measured it in the process that will train (``strategy="auto"`` does); None: a new probe measures a
fresh process's libraries (see [Note: process memory]).

``target_device``: read the probe for another device (a name of
:data:`dspark.planner.device_profile.DEVICES`, or a :class:`DeviceProfile`): its compute and memory
times scaled by the two devices' rates, the default budget that device's memory, no process peak
(see [Note: device profiles]); the plan's header names both devices and the ratios.

    Example::

        plan = dspark.plan(model, (x, y), F.cross_entropy, devices=[1, 2], precision="bf16")
        print(plan); plan.best(devices=2)
    """
    counts = sorted(set(devices))
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"devices={list(devices)!r} must be ints >= 1")
    every = strategies == "all"
    names = [*STRATEGIES, *HYBRID_STRATEGIES] if every else [strategies] if isinstance(strategies, str) \
        else list(strategies)
    unknown = [s for s in names if s not in all_strategies()]
    if unknown or not names:
        raise ValueError(f"strategies={strategies!r}: each must be one of {', '.join(all_strategies())} "
                         "(or 'all')")
    precision_policy(precision)  # validates
    if shard_group_size is not None and (isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int)
                                         or shard_group_size < 1):
        raise ValueError(f"shard_group_size={shard_group_size!r} must be an int >= 1 (ranks per shard group), "
                         "or None for one node of the interconnect")
    if shard_group_size is not None:
        check_shard_group_size(counts, shard_group_size, names, every=every)
    if memory_budget is not None and memory_budget <= 0:
        raise ValueError(f"memory_budget={memory_budget!r} must be bytes > 0 (or None)")
    where = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    link = interconnect if isinstance(interconnect, Interconnect) else get_interconnect(
        interconnect or ("nvlink" if where.type == "cuda" else "loopback-gloo"))
    rows_given = batch_size(sample_batch)
    total = rows_given if global_batch is None else global_batch
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"global_batch={global_batch!r} must be an int >= 1")
    too_small = [n for n in counts if total % n]
    if too_small:
        raise ValueError(f"global_batch={total} does not split evenly over devices {too_small}: "
                         f"{total} % {too_small[0]} = {total % too_small[0]}; pick counts that divide it")
    if probe is None:
        largest = min(total // counts[0], max_micro_batch or total)
        smallest = max(1, min(largest // 4, total // counts[-1]))
        if smallest == largest:
            smallest = max(1, largest // 2)
        probe = _new_probe(model, sample_batch, loss_fn, optimizer=optimizer, precision=precision,
                           device=where, trace=trace, library_baseline=process_baseline_bytes is None,
                           batches=(smallest, largest) if smallest != largest else (largest, largest))
    if process_baseline_bytes is not None:
        probe = dataclasses.replace(probe, process_baseline_bytes=process_baseline_bytes, baseline_in_rank=True)
    target = get_device_profile(target_device) if isinstance(target_device, str) else target_device
    if target is not None:
        probe = scale_probe(probe, profile_of(probe.device), target)
    shape = model_shape(model, probe.optimizer_state)
    rows = []
    for n in counts:
        budget = memory_budget
        if budget is None and target is not None:
            budget = int(target.memory_bytes * (1 - MEMORY_MARGIN))
        if budget is None:
            budget = default_memory_budget(where, local_ranks=1 if where.type == "cuda" else n)
        for strategy in names:
            group = None
            if strategy in HYBRID_STRATEGIES:
                group = hybrid_group(link, n, shard_group_size, required=not every)
                if group is None:
                    continue  # "all": no split into several groups of several ranks here
            rows.append(_fit_row(shape, probe, strategy, n, total // n, budget, bucket_mb, link,
                                 max_micro_batch, group))
    return Plan(rows=tuple(rows), global_batch=total, precision=precision, interconnect=link.name,
                memory_budget_bytes=memory_budget, probe=probe)


TRACES = ("auto", "measure", "fake")
"""How :func:`plan` makes a probe: see its ``trace``."""


def _new_probe(model: nn.Module, sample_batch: Any, loss_fn: LossFn | None, *,
               optimizer: Callable[..., torch.optim.Optimizer], precision: str, device: torch.device,
               trace: str, batches: tuple[int, int], library_baseline: bool) -> Probe:
    if trace not in TRACES:
        raise ValueError(f"trace={trace!r} is not one of {', '.join(TRACES)}")
    if trace == "auto":
        state = sum(state_bytes(model_shape(model), "replicate", 1).values())
        try:
            activations = fake_activation_bytes(model, sample_batch, loss_fn=loss_fn, precision=precision,
                                                device=device, rows=batches[1])
        except Exception as exc:  # an operator fake tensors cannot run: measure (or refuse) instead
            log.debug("fake trace failed (%r); measuring", exc)
            activations = 0
        trace = "fake" if state + activations > default_memory_budget(device) else "measure"
    if trace == "fake":
        shape = model_shape(model, optimizer_state_of(optimizer))
        unit_bytes = [sum(math.prod(shape.trainable[i][0]) * shape.trainable[i][1].itemsize for i in unit)
                      for unit in shape.units]
        return fake_probe(model, sample_batch, loss_fn=loss_fn, precision=precision, device=device,
                          batches=batches, unit_bytes=unit_bytes, optimizer_state=shape.optimizer_state)
    _check_probe_fits(model, device)
    return measure_probe(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, precision=precision,
                         device=device, batches=batches, units=[name for name, _ in unit_modules(model)],
                         library_baseline=library_baseline)


def _check_probe_fits(model: nn.Module, device: torch.device) -> None:
    """The probe trains a whole copy on one device: refuse, with the numbers, where its model state
    alone (AdamW's 16 bytes per fp32 parameter) would not fit in that device's memory (the
    per-rank ``memory_budget`` is for the planned ranks, not for the probe)."""
    state = sum(state_bytes(model_shape(model), "replicate", 1).values())
    room = default_memory_budget(device)
    if state > room:
        raise ValueError(f"the probe trains the whole model on {device} and its one-device model state "
                         f"({_mb(state)}) exceeds the {_mb(room)} there; probe it on a device where it "
                         "fits and pass probe= (dspark plan --probe PATH), or build one with "
                         "Probe.from_one_step from a measured step, or pass trace='fake' for its memory")


def _fit_row(shape: ModelShape, probe: Probe, strategy: str, n: int, local: int, budget: int,
             bucket_mb: float, link: Interconnect, max_micro_batch: int | None,
             shard_group_size: int | None = None) -> PlanRow:
    """The row at the largest micro-batch that fits ``budget`` (the smallest when none does)."""
    row = None
    for micro in _micro_batches(local, max_micro_batch):
        cost = row_cost(shape=shape, probe=probe, strategy=strategy, num_ranks=n, micro_batch=micro,
                        passes=local // micro, bucket_mb=bucket_mb, link=link, shard_group_size=shard_group_size)
        row = PlanRow(strategy=strategy, devices=n, micro_batch=micro, passes=local // micro,
                      budget_bytes=budget, fits=needed_bytes(cost) <= budget, shard_group_size=shard_group_size,
                      **asdict(cost))
        if row.fits:
            return row
    if row is None:
        raise AssertionError(f"no micro-batch for local batch {local}")
    return row
