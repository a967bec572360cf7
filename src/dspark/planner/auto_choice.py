"""``Engine(strategy="auto")``'s choice, a plain function the engine calls: plan the model on the
current world, pick the fastest strategy that fits the memory budget, the same on every rank (see
[Note: auto as a plain function] in :mod:`dspark.engine.auto_strategy`).

[Note: what auto knows] At construction the engine has a model and an optimizer but no batch:
activations and compute cannot be measured yet. What differs between strategies can: model state
(exact), communication buffers (the engine's real sizes) and the communication each strategy
adds, over the link measured here by a short probe of each collective ([Note: the link probe]). So
auto plans with activations and compute left out (the table says so) and ranks the strategies that
fit by their communication and optimizer time; with compute the same for every strategy, that order
is the step's order. Ties (within :data:`TIE_SHARE` of the step, or :data:`TIE_MS`) go to the less
sharded strategy: on a small model the strategies differ by a collective's latency or two, less than
the link probe resolves, and a measured difference that small is noise, not a reason to shard. With
a batch, a row whose step range (the probe's rounds, ``step_ms_low``) reaches the fastest row's
``step_ms_high`` ties too: on a busy machine the rounds spread, and a gap inside that spread is not
one the probe measured. Rank
0 measures and decides, and broadcasts its choice, so every rank builds the same engine. Given
``sample_batch=`` (one step's batch on a rank) the engine has what :func:`dspark.plan` needs, and
auto plans activations, compute and the micro-batch too (see [Note: auto with a batch]).

[Note: auto's own probes and the budget] Before it chooses, auto runs code of its own in the
processes the budget is for: the link probe on every rank (each collective at up to the largest of
:data:`dspark.planner.link_probe.SIZES`), and, given a batch, on rank 0 the probe's copy of the
model trained at two batch sizes and the page-fault probe. Their peak is no row's: on a small model
it is above every strategy's (a gather of tens of MB and its packed copies, against a model of a few
MB), and on a large one the probe's whole copy of the model state is more than a sharded row holds.
``memory_budget`` counts the process from the engine's construction on, so auto reads each rank's
high water (:func:`dspark.planner.process_memory.high_water_bytes`) before and after measuring,
never resetting it (that is the program's to do); where the probes set a new high over the budget,
auto refuses on every rank, naming the rank and the peak (:attr:`Plan.probing_peak_bytes` keeps it
where it fits). Below the process's earlier high water the probes' own peak is not known, and not
needed: the process had been there before the engine. What the probes freed goes back to the
kernel (:func:`dspark.cpu_malloc.release_freed`) before the rows' baseline is read: left resident,
it varied by up to a hundred MB from run to run on the same model and moved every row's process peak
with it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from dspark import comm
from dspark.comm import World
from dspark.cpu_malloc import release_freed
from dspark.planner.co_run import AUTO_CO_RUN_SIZES
from dspark.planner.cost import row_cost
from dspark.planner.interconnect import Interconnect
from dspark.planner.link_probe import measure_link
from dspark.planner.probe import Probe, batch_size, optimizer_state_of
from dspark.planner.probe_budget import probe_need
from dspark.planner.process_memory import HEAP_SHARE, high_water_bytes, process_bytes, this_process_baseline_bytes
from dspark.planner.table import (
    Plan,
    PlanRow,
    default_memory_budget,
    describe_need,
    model_shape,
    needed_bytes,
    plan,
)
from dspark.policy.rank_groups import group_layout
from dspark.policy.strategies import HYBRID_STRATEGIES, STRATEGIES, all_strategies

__all__ = ["TIE_MS", "TIE_SHARE", "AutoChoice", "AutoRequest", "announce", "auto_choice", "auto_plan", "choose"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoRequest:
    """What the engine knows at construction, handed to :func:`auto_choice`."""

    model: nn.Module
    optimizer: Callable[..., torch.optim.Optimizer]
    precision: str
    bucket_mb: float
    memory_budget: int | None
    """Bytes per rank the strategy must fit in; None: the device's memory less a margin."""
    world: World
    sample_batch: Any = None
    """One step's batch as this rank's loop gets it (before any split into micro-batches); None:
    no batch at construction, so no micro-batch is chosen (see [Note: what auto knows])."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """``loss_fn(model(inputs), targets)`` for ``sample_batch = (inputs, targets)``; None: the model
    returns its loss."""
    grad_accum_steps: int | None = None
    """The loop's own accumulation when the user set it (the micro-batch is then fixed); None: auto
    may choose it with the micro-batch."""
    shard_group_size: int | None = None
    """The shard group a hybrid strategy would run in; None: a node's ranks (``LOCAL_WORLD_SIZE``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoChoice:
    """What the engine runs: the strategy ``strategy="auto"`` chose (or the one given by name), the
    same on every rank."""

    strategy: str
    plan: Plan | None
    """The plan the choice came from (None: a strategy given by name)."""
    grad_accum_steps: int | None = None
    """Micro-batches per step auto planned (None: not chosen, no sample batch)."""
    micro_batch: int | None = None
    """Rows per forward auto planned on each rank (None: not chosen)."""

TIE_SHARE = 0.02
"""Steps within this share of the fastest count as equal; the less sharded strategy wins the tie."""
TIE_MS = 1.0
"""Steps within a millisecond of the fastest count as equal too: the link probe fits each
collective's latency from a few timings of two sizes, and on a loaded machine those fits move by
fractions of a millisecond, enough to reorder strategies whose whole difference is one latency."""


def auto_plan(model: nn.Module, *, optimizer: object, precision: str, bucket_mb: float,
              num_ranks: int, bus_bytes_per_s: float, backend: str, memory_budget: int,
              link: Interconnect | None = None, shard_group_size: int | None = None,
              process_baseline_bytes: int = 0) -> Plan:
    """Every strategy's row on ``num_ranks`` ranks as auto sees it (see [Note: what auto knows]),
    over ``link`` (:func:`dspark.planner.link_probe.measure_link`'s) or else one all-reduce bandwidth;
    with ``shard_group_size`` (several nodes: :func:`hybrid_layout`), the hybrid strategies' rows too;
    ``process_baseline_bytes`` (read in this rank) gives each row a process peak on a CPU.

    Example::

        auto_plan(model, optimizer=torch.optim.AdamW, precision="fp32", bucket_mb=25.0, num_ranks=2,
                  bus_bytes_per_s=1e9, backend="gloo", memory_budget=8 << 30)
    """
    shape = model_shape(model, optimizer_state_of(optimizer))  # type: ignore[arg-type]
    unit_bytes = [sum(shape.trainable[i][1].itemsize * _numel(shape.trainable[i][0]) for i in unit)
                  for unit in shape.units]
    probe = Probe.from_one_step(device="not measured", batch=1, forward_ms=0.0, backward_ms=0.0,
                                optimizer_ms=0.0, step_bytes=0.0, num_params=len(shape.trainable),
                                unit_bytes=unit_bytes, optimizer_state=shape.optimizer_state)
    if process_baseline_bytes:
        probe = dataclasses.replace(probe, process_baseline_bytes=process_baseline_bytes, baseline_in_rank=True,
                                    allocator_share=HEAP_SHARE)
    gloo = backend == "gloo"
    if link is None:
        link = Interconnect(name="measured", bytes_per_s=bus_bytes_per_s or 1e9,
                            latency_s=50e-6 if gloo else 5e-6, overlaps_compute=not gloo,
                            source="a short all-reduce on this world")
    rows = []
    hybrid = list(HYBRID_STRATEGIES) if shard_group_size is not None else []
    for strategy in [*STRATEGIES, *hybrid]:
        group = shard_group_size if strategy in HYBRID_STRATEGIES else None
        cost = row_cost(shape=shape, probe=probe, strategy=strategy, num_ranks=num_ranks,
                        micro_batch=1, passes=1, bucket_mb=bucket_mb, link=link, shard_group_size=group)
        fields = {k: getattr(cost, k) for k in cost.__dataclass_fields__}
        rows.append(PlanRow(strategy=strategy, devices=num_ranks, micro_batch=0, passes=1, shard_group_size=group,
                            budget_bytes=memory_budget, fits=needed_bytes(cost) <= memory_budget, **fields))
    return Plan(rows=tuple(rows), global_batch=0, precision=precision,
                interconnect=f"measured {link.bytes_per_s / 1e9:.2f} GB/s", memory_budget_bytes=memory_budget,
                probe=probe)


def choose(plan: Plan, micro_batch: int | None = None) -> PlanRow:
    """The fastest row that fits, ties (within :data:`TIE_SHARE` or :data:`TIE_MS`, or a step range
    that reaches the fastest's) to the less sharded; with ``micro_batch``, only rows planned at that
    micro-batch (the loop's own). A clear ``ValueError`` when none fits."""
    rows = [r for r in plan.rows if micro_batch is None or r.micro_batch == micro_batch]
    fitting = [r for r in rows if r.fits]
    if not fitting:
        plan.best()  # raises, naming the smallest need and the budget
        smallest = min(rows or plan.rows, key=needed_bytes)
        raise ValueError(f"no strategy fits at the loop's micro-batch of {micro_batch} rows: the smallest "
                         f"need there is {describe_need(smallest)}, over the budget of "
                         f"{smallest.budget_bytes / 1e6:,.1f} MB; leave grad_accum_steps out so that auto "
                         "may choose a smaller micro-batch, or raise memory_budget")
    fastest = min(fitting, key=lambda r: r.step_ms)
    order = list(all_strategies())
    limit = max(fastest.step_ms * (1 + TIE_SHARE), fastest.step_ms + TIE_MS) + 1e-9
    if fastest.step_ms_high is not None:  # the probe's rounds could not tell them apart either
        limit = max(limit, fastest.step_ms_high + 1e-9)
    ties = [r for r in fitting if r.step_ms <= limit or (r.step_ms_low is not None and r.step_ms_low <= limit)]
    return min(ties, key=lambda r: order.index(r.strategy))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def auto_choice(request: AutoRequest) -> AutoChoice:
    """The fastest strategy that fits ``request.memory_budget`` on the current world, the same on
    every rank (rank 0 measures and decides; see [Note: what auto knows]); with a sample batch, the
    micro-batch too ([Note: auto with a batch]).

    Example::

        choice = auto_choice(AutoRequest(model=m, optimizer=opt, precision="fp32", bucket_mb=25.0,
                                         memory_budget=None, world=dspark.get_world()))
        choice.strategy, choice.plan   # "replicate", Plan(...)
    """
    world = request.world
    before = high_water_bytes(world.device)  # see [Note: auto's own probes and the budget]
    link = measure_link(world, repeats=3, co_run_sizes=AUTO_CO_RUN_SIZES) if world.world_size > 1 else None
    group_size = hybrid_layout(world, request.shard_group_size)
    if link is not None and group_size is not None:  # two levels: the nodes' own links, and the world's
        inside = measure_link(world, repeats=3, group=comm.partition_groups(
            group_layout(world.world_size, shard_group_size=group_size).shard_groups(), name="shard"))
        link = replace(inside, name=f"{inside.name}+{link.name}", ranks_per_node=group_size, inter_node=link,
                       co_run=link.co_run)  # measured over the world, every node's ranks at once
    bandwidth = link.bytes_per_s if link is not None else 0.0
    budget = request.memory_budget
    if budget is None:
        local = 1 if world.device.type == "cuda" else world.local_world_size
        budget = default_memory_budget(world.device, local_ranks=local)
    with_batch = request.sample_batch is not None
    # the link is rank 0's on every rank already (measure_link broadcasts it); the budget may
    # differ by rank (a host's available memory, or the program's own reading of it): the smallest
    # holds on every rank; another rank may pass no batch ([Note: auto with a batch]): rank 0's
    # decides
    if world.world_size > 1:
        everyone = comm.all_gather_object((budget, with_batch), label="dspark.auto.budget")
        budget, with_batch = min(b for b, _ in everyone), everyone[0][1]
    if with_batch:
        return _resolve_with_batch(request, budget, link, group_size, before)
    release_freed()  # what the link probe freed: see [Note: auto's own probes and the budget]
    table = auto_plan(request.model, optimizer=request.optimizer, precision=request.precision,
                      bucket_mb=request.bucket_mb, num_ranks=world.world_size,
                      bus_bytes_per_s=bandwidth, backend=world.backend, memory_budget=budget, link=link,
                      shard_group_size=group_size,
                      process_baseline_bytes=this_process_baseline_bytes(world.device)
                      if world.device.type == "cpu" else 0)
    table = _with_probing_peak(table, before, budget, world, "the link probe's collectives")
    chosen = choose(table).strategy
    if world.rank == 0:
        announce(f"strategy='auto' chose {chosen} on {world.world_size} rank(s) (engine.plan); activations "
                 "and compute not measured at construction (no batch yet: pass sample_batch= to the "
                 f"engine to plan them and the micro-batch)\n{table}")
    return AutoChoice(strategy=chosen, plan=table)


def hybrid_layout(world: World, shard_group_size: int | None) -> int | None:
    """The shard group size auto plans hybrid rows with on ``world``: ``shard_group_size``, or one
    node's ranks (``LOCAL_WORLD_SIZE``); None where that makes no several groups of several ranks
    (one node), or does not divide the world (the engine would refuse it).

    Example::

        hybrid_layout(world, None)   # 8 on 2 nodes of 8 ranks, None on one node
    """
    size = world.local_world_size if shard_group_size is None else shard_group_size
    if not 1 < size < world.world_size or world.world_size % size:
        return None
    return size


def announce(message: str) -> None:
    """Show auto's choice: through logging where the program set logging up (a handler on this
    logger or above it), else on stderr, so that the choice is never silent by default.

    Example::

        announce("strategy='auto' chose zero2 on 2 rank(s)")
    """
    if log.hasHandlers():
        log.info("%s", message)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def _with_probing_peak(table: Plan, before: int, budget: int, world: World, probes: str) -> Plan:
    """``table`` with the highest new high water any rank reached since ``before`` while auto
    measured (``probes`` names what ran); a ``ValueError`` on every rank where that is over
    ``budget`` (see [Note: auto's own probes and the budget])."""
    after = high_water_bytes(world.device)
    mine = after if after > before else 0
    peaks = comm.all_gather_object(mine, label="dspark.auto.probing_peak") if world.world_size > 1 else [mine]
    rank = max(range(len(peaks)), key=peaks.__getitem__)
    if peaks[rank] > budget:
        raise ValueError(f"strategy='auto' measured this world before choosing, and its own probes ({probes}) "
                         f"took rank {rank}'s process to {peaks[rank] / 1e6:,.1f} MB, over memory_budget="
                         f"{budget} ({budget / 1e6:,.1f} MB), which counts the process from the engine's "
                         "construction on; raise memory_budget, or name the strategy (strategy='zero2', say) "
                         "after comparing the strategies' needs with dspark.plan in another process")
    return replace(table, probing_peak_bytes=peaks[rank] or None)


def _probe_within(request: AutoRequest, rows: int, fixed: int | None, budget: int) -> int | None:
    """The largest micro-batch rank 0's probe may train within ``budget`` (see [Note: the probe
    inside the budget] in :mod:`dspark.planner.probe_budget`): the loop's own where it set
    ``grad_accum_steps``, else the largest equal split of the ``rows`` whose probe is predicted to
    fit; None where nothing could be predicted (the probe trains the whole batch). A ``ValueError``
    where not even the smallest fits."""
    candidates = [rows // fixed] if fixed is not None else [m for m in range(rows, 0, -1) if rows % m == 0]
    device = request.world.device
    need = probe_need(request.model, request.sample_batch, loss_fn=request.loss_fn, optimizer=request.optimizer,
                      precision=request.precision, device=device, rows=candidates[0])
    if need is None:
        return None if fixed is None else candidates[0]
    release_freed()  # what the link probe freed is not the probe's to count
    now = process_bytes(device)
    cap = need.largest_within(candidates, budget - now)
    if cap is None:
        smallest = candidates[-1]
        which = "the loop's micro-batch" if fixed is not None else "one row"
        raise ValueError(f"strategy='auto' probes the model on rank 0 before choosing, and at {which} "
                         f"({smallest} row(s) per step) its probe is predicted to take this process from "
                         f"{now / 1e6:,.1f} MB to {(now + need.rise_bytes(smallest)) / 1e6:,.1f} MB, over "
                         f"memory_budget={budget} ({budget / 1e6:,.1f} MB); raise memory_budget, or name the "
                         "strategy (strategy='zero2', say) after comparing the strategies' needs with dspark.plan "
                         "in another process")
    return cap


def _resolve_with_batch(request: AutoRequest, budget: int, link: Interconnect | None,
                        group_size: int | None, before: int) -> AutoChoice:
    """[Note: auto with a batch] Given one step's batch, auto plans as :func:`dspark.plan` does on
    this world: activations and compute measured by a probe on rank 0's device (the others wait:
    ranks sharing a machine would slow the probe), every strategy at the largest micro-batch that
    fits, and the loop's micro-batch kept when it set ``grad_accum_steps``. Rank 0 broadcasts the
    plan, or the error it met, so every rank chooses the same or raises the same; only rank 0's
    batch is read, so the other ranks may pass ``sample_batch=None``."""
    world = request.world
    fixed = request.grad_accum_steps
    result: Plan | BaseException | None = None
    if world.rank == 0:  # only rank 0's batch is read: the other ranks' may differ, or be bad
        # the probe's steps draw from the random generators (dropout, a meta model's init): leave
        # them as they were, so the engine's own initialisation and the loop's draws are unchanged
        cuda = [world.device.index or 0] if world.device.type == "cuda" else []
        try:
            rows = batch_size(request.sample_batch)
            if fixed is not None and rows % fixed:
                raise ValueError(f"sample_batch has {rows} rows, which grad_accum_steps={fixed} does not "
                                 f"split into equal micro-batches ({rows} % {fixed} = {rows % fixed})")
            settings: dict[str, Any] = {"optimizer": request.optimizer, "devices": [world.world_size],
                        "precision": request.precision, "global_batch": rows * world.world_size,
                        "memory_budget": budget, "interconnect": link, "bucket_mb": request.bucket_mb,
                        "device": world.device, "shard_group_size": group_size}
            with torch.random.fork_rng(devices=cuda):  # the largest micro-batch the probe may train
                settings["max_micro_batch"] = _probe_within(request, rows, fixed, budget)
                measured = plan(request.model, request.sample_batch, request.loss_fn, **settings,
                                process_baseline_bytes=0)
            # the baseline read after the probe ran here, once the heap has given back what the
            # probe freed (see [Note: auto's own probes and the budget])
            release_freed()
            result = plan(request.model, request.sample_batch, request.loss_fn, **settings, probe=measured.probe,
                          process_baseline_bytes=this_process_baseline_bytes(world.device))
        except Exception as exc:  # every rank raises it, not only rank 0
            result = exc
    if world.world_size > 1:
        result = comm.broadcast_object(result)
    if isinstance(result, BaseException):
        raise result
    if not isinstance(result, Plan):
        raise AssertionError(f"rank 0 sent {type(result).__name__}, not a plan")
    probes = "the model's copy trained at two batch sizes"
    result = _with_probing_peak(result, before, budget, world, probes if world.world_size == 1 else
                                f"the link probe's collectives and, on rank 0, {probes}")
    rows = result.global_batch // world.world_size
    row = choose(result, micro_batch=None if fixed is None else rows // fixed)
    if world.rank == 0:
        split = ("; split each step's batch with engine.micro_batches(batch)" if row.passes > 1 else "")
        announce(f"strategy='auto' chose {row.strategy} at micro-batch {row.micro_batch} x {row.passes} "
                 f"on {world.world_size} rank(s) (engine.plan, engine.micro_batch, "
                 f"engine.grad_accum_steps){split}\n{result}")
    return AutoChoice(strategy=row.strategy, plan=result, grad_accum_steps=row.passes,
                      micro_batch=row.micro_batch)

