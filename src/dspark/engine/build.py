"""Building the engine's pieces on each rank: the model placed on its device (equal to rank 0's,
materialised from the meta device if need be, zero3 keeping only this rank's rows), the optimizer
built by the user's factory over the tensors the engine updates, and the parts that run a step around
them (:func:`build_parts`, which ``Engine.__init__`` calls once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dspark import comm, cpu_malloc
from dspark.comm import World
from dspark.engine.auto_strategy import check_planned_rows
from dspark.engine.backward import BackwardPass
from dspark.engine.batch_check import BatchCheck
from dspark.engine.buffer_sync import BufferSync, broadcast_tensors
from dspark.engine.config import EngineConfig
from dspark.engine.failure_agreement import agreed
from dspark.engine.global_batchnorm import convert_batchnorm, restore_batchnorm
from dspark.engine.grad_reducer import GradReducer, LocalReducer
from dspark.engine.heap_guard import HeapGuard
from dspark.engine.inputs import ForwardInputs, InputRecorder, Reader
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.optimizer_guard import ShardedOptimizerGuard, check_elementwise
from dspark.engine.param_groups import group_by_overrides
from dspark.engine.param_slot import ParamSlot
from dspark.engine.rank_groups import RankGroups, form_rank_groups
from dspark.engine.state_dict import StateDicts
from dspark.engine.step_observer import StepObserver
from dspark.engine.trace import TraceSession
from dspark.engine.update import Update
from dspark.engine.validation import (
    check_no_sync_batchnorm_on_cpu,
    check_same_model_on_every_rank,
    check_same_optimizer_on_every_rank,
    unique_params,
    warn_unknown_group_options,
)
from dspark.engine.window import Window
from dspark.engine.zero3_guard import Zero3StateDictGuard
from dspark.engine.zero3_units import Zero3Scheduler
from dspark.meta.materialize import has_meta_tensors, materialize
from dspark.policy.optimizer_kernel import prefer_fused_kernel
from dspark.policy.strategies import ShardingPolicy, precision_policy
from dspark.policy.units import UnitPolicy

__all__ = ["SHARDED_REDUCE", "EngineParts", "OptimizerFactory", "build_optimizer", "build_parts",
           "place_model", "shard_parameters"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def place_model(model: nn.Module, named: Sequence[tuple[list[str], nn.Parameter]], slot_of: dict[int, ParamSlot],
                *, world: World, shard: comm.Group, shard_params: bool) -> None:
    """Give ``model`` real storage on this rank's device, equal to rank 0's, and a slot in ``slot_of``
    (by ``id``) for each parameter the engine manages: the trainable ones, and under zero3 (which keeps
    only this rank's rows of each parameter) the frozen ones too. ``named``: :func:`unique_params`;
    ``shard``: the group whose ranks split each parameter's rows (the world, or a hybrid shard group)."""
    n, device = world.world_size, world.device
    names_of = {id(p): names for names, p in named}

    def keep(p: nn.Parameter) -> None:
        if not (shard_params or p.requires_grad):
            return
        slot = ParamSlot(names_of[id(p)], p, rank=shard.rank, num_ranks=shard.size)
        slot_of[id(p)] = slot
        if shard_params:
            slot.shard_and_free_full()

    if has_meta_tensors(model):
        def on_final(name: str, p: nn.Parameter) -> None:
            if n > 1:
                # rank 0's values, whatever each rank's seed
                broadcast_tensors([p.data], label="dspark.construction.broadcast")
            keep(p)
            if shard_params and device.type == "cpu":
                cpu_malloc.release_freed()  # the whole parameter is gone: see [Note: one-off phases]

        materialize(model, device, on_final)
        if n > 1:
            broadcast_tensors(list(model.buffers()), label="dspark.construction.broadcast")
        return
    model.to(device)
    if n > 1:
        broadcast_tensors([p.detach() for _, p in named] + list(model.buffers()),
                          label="dspark.construction.broadcast")
    for _, p in named:
        keep(p)


def build_optimizer(factory: OptimizerFactory, slots: Sequence[ParamSlot],
                    groups: list[tuple[dict[str, Any], list[int]]] | None, *, module: nn.Module,
                    strategy: ShardingPolicy, rank: int) -> torch.optim.Optimizer:
    """Call the user's optimizer ``factory`` with the tensors the engine updates (whole parameters, or
    this rank's rows of each under zero1-3), in ``groups`` (``param_groups=``) if given, and refuse an
    optimizer over tensors it was not given."""
    def opt_param(slot: ParamSlot) -> nn.Parameter:
        p = slot.opt_param if strategy.shard_optimizer else slot.param
        if p is None:
            raise AssertionError(f"{slot.name}: no tensor for the optimizer")
        return p

    if groups is None:
        mine = [opt_param(s) for s in slots if opt_param(s).numel() > 0]
        # a rank that owns no row of any parameter (a small model on many ranks) still gets an
        # optimizer, with one empty group: PyTorch refuses an empty parameter list
        built = factory(mine if mine else [{"params": []}])
    else:
        built = factory([{"params": [opt_param(slots[i]) for i in indices
                                     if opt_param(slots[i]).numel() > 0], **overrides}
                         for overrides, indices in groups])
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a "
                        "torch.optim.Optimizer")
    given = {id(opt_param(s)) for s in slots}
    foreign = [p for group in built.param_groups for p in group["params"] if id(p) not in given]
    if foreign:
        names = {id(p): name for name, p in module.named_parameters()}
        shown = ", ".join(names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in foreign[:3])
        raise ValueError(
            f"the optimizer factory built an optimizer over {len(foreign)} tensor(s) it was not "
            f"given ({shown}{' ...' if len(foreign) > 3 else ''}): it must optimise the parameters "
            f"it is called with, which are the tensors the engine updates (under "
            f"{strategy.name!r}, this rank's rows of each parameter). Pass "
            f"functools.partial(torch.optim.AdamW, lr=...), or lambda params: "
            f"torch.optim.AdamW(params, ...), not one that reads model.parameters()")
    if groups is not None and rank == 0:
        warn_unknown_group_options(built, groups, list(slots))
    if prefer_fused_kernel(built):
        log.debug("rank %d: %s steps with its fused kernel", rank, type(built).__name__)
    return built


def shard_parameters(model: nn.Module, slots: Sequence[ParamSlot], *, strategy: ShardingPolicy, world: World,
                     shard: comm.Group, policy: UnitPolicy, in_backward: Callable[[], bool],
                     window: Callable[[], int]) -> tuple[Zero3Scheduler | None, Zero3StateDictGuard | None]:
    """zero3 on a ``shard`` group of several ranks: the scheduler that gathers each unit's parameters
    just in time over that group, and the guard that keeps ``model.state_dict()`` from returning
    freed (empty) tensors (see [Note: state dicts under zero3]). Elsewhere a rank's shard of a
    parameter is the whole parameter."""
    if strategy.splits_params_on(shard.size):
        return (Zero3Scheduler(model, list(slots), policy=policy, in_backward=in_backward, window=window,
                               group=shard),
                Zero3StateDictGuard(model, slots, rank=world.rank))
    if strategy.shard_optimizer:  # zero1/zero2 (and zero3 on one rank) keep the parameter in place
        for slot in slots:
            if slot.requires_grad:
                slot.view_shard_of_full()
    return None, None


# How zero2/zero3 reduce gradient shards, per backend: a reduce-scatter where the backend has a good
# one (gloo's goes through an all-to-all, see [Note: reduce-scatter on gloo] in dspark.comm), else an
# all-reduce of the whole bucket, each rank keeping its rows. Tests and benchmarks set an entry to
# run the other path on their backend.
SHARDED_REDUCE = {"nccl": "reduce_scatter", "gloo": "reduce_scatter"}


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineParts:
    """What :func:`build_parts` builds for one engine, which keeps it: the slots, the optimizer, and
    the parts that run its forward, backward, update, state dicts and step breakdown."""

    slots: list[ParamSlot]
    """The trainable parameters, one slot each (tied parameters share one)."""
    rank_groups: RankGroups
    """The shard group (and, hybrid, the replica group) the step's collectives run over."""
    frozen_slots: list[ParamSlot]
    shard_params: bool
    batch_check: BatchCheck
    batchnorms: list[nn.Module]
    zero3: Zero3Scheduler | None
    zero3_guard: Zero3StateDictGuard | None
    optimizer: torch.optim.Optimizer
    reducer: GradReducer | LocalReducer
    update: Update
    states: StateDicts
    backward_pass: BackwardPass
    hooks: list[Any]
    inputs: InputRecorder
    observer: StepObserver

    def close(self) -> None:
        """Remove the hooks (the module works as a plain module again unless zero3), restore the
        converted BatchNorm layers and stop the trace, if one is still recording."""
        self.observer.close()
        self.inputs.remove()
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        if self.zero3 is not None:
            self.zero3.remove_hooks()
        if self.zero3_guard is not None:
            self.zero3_guard.remove()
        restore_batchnorm(self.batchnorms)
        self.batchnorms.clear()


def build_parts(model: nn.Module, factory: OptimizerFactory, *, config: EngineConfig, world: World,
                strategy: ShardingPolicy, grad_accum_steps: int, window: Window, loss_scaler: LossScaler | None,
                step_count: Callable[[], int], defer_host_reads: bool,
                planned_micro_batch: int | None = None) -> EngineParts:
    """Check that every rank has the same model and optimizer, place the model, build the optimizer
    and wire the parts of a step around them, in the same order on every rank (each check and
    broadcast is collective). ``config``: the engine's options; ``strategy`` and ``grad_accum_steps``
    as they run (``strategy="auto"``'s choice); the engine's own state comes in as values: its
    accumulation ``window``, its fp16 ``loss_scaler`` and ``step_count()``, the steps applied so
    far; ``defer_host_reads``: the update reads the device in a GPU's order.
    ``planned_micro_batch``: the rows per training forward ``strategy="auto"`` planned, refused
    above it.

    Example::

        parts = build_parts(model, functools.partial(torch.optim.SGD, lr=0.1), config=EngineConfig(),
                            world=world, strategy=STRATEGIES["replicate"], grad_accum_steps=1, ...)
        parts.close()   # the module is a plain module again (unless zero3)
    """
    n, rank = world.world_size, world.rank
    precision = precision_policy(config.precision)
    comm_config, checks, observation = config.communication, config.checks, config.observation
    check_same_model_on_every_rank(model, rank, config.agreed_settings())
    named = unique_params(model)
    trainable = [(names[0], p) for names, p in named if p.requires_grad]
    param_groups = config.param_groups
    groups = agreed("param_groups", lambda: None if param_groups is None else
                    group_by_overrides(trainable, param_groups))
    rank_groups = form_rank_groups(world, strategy, shard_group_size=(
        comm_config.shard_group_size if strategy.hybrid else None))  # see [Note: hybrid sharding]
    shard = rank_groups.shard
    shard_params = strategy.splits_params_on(shard.size)
    # identical input batches on two ranks raise PlacementError (see engine/batch_check.py)
    batch_check = BatchCheck(every=checks.batch_check_every, step_count=step_count)
    slot_of: dict[int, ParamSlot] = {}
    agreed("placing the model on its device",
           lambda: place_model(model, named, slot_of, world=world, shard=shard, shard_params=shard_params))
    all_slots = [slot_of[id(p)] for _, p in named if id(p) in slot_of]
    slots = [s for s in all_slots if s.requires_grad]
    check_no_sync_batchnorm_on_cpu(model, world.device)
    batchnorms = convert_batchnorm(model) if comm_config.sync_batchnorm else []
    buffer_sync = None
    if comm_config.broadcast_buffers and n > 1:
        skip = {id(b) for m in batchnorms for b in m.buffers(recurse=False)}
        buffer_sync = BufferSync(model, skip=skip)

    zero3, zero3_guard = shard_parameters(
        model, all_slots, strategy=strategy, world=world, shard=shard, policy=comm_config.zero3_units,
        in_backward=lambda: window.in_backward, window=lambda: window.index)
    optimizer = agreed("building the optimizer", lambda: build_optimizer(
        factory, slots, groups, module=model, strategy=strategy, rank=rank))
    check_same_optimizer_on_every_rank(optimizer, rank)
    if strategy.splits_optimizer_on(shard.size):
        check_elementwise(optimizer, strategy=strategy.name, after_step=False)
    sharded = strategy.shard_grads
    collective = SHARDED_REDUCE.get(world.backend, "all_reduce") if sharded else "all_reduce"
    # see [Note: non-finite gradients found in the reduction]
    check_finite = checks.skip_nonfinite or loss_scaler is not None
    reducer = LocalReducer(slots, sharded=sharded, check_finite=check_finite) if n == 1 else GradReducer(
        slots, sharded=sharded, collective=collective, bucket_mb=comm_config.bucket_mb,
        wire_dtype=comm_config.reduce_dtype, rank=rank, num_ranks=n, device=world.device,
        check_finite=check_finite, shard=shard, replica=rank_groups.replica)

    heap_guard = (HeapGuard(read=cpu_malloc.heap_usage, trim=cpu_malloc.release_freed, rank=rank)
                  if world.device.type == "cpu" and cpu_malloc.guard_wanted() else None)

    def after_optimizer() -> None:
        """zero1/zero2: check the sharded optimizer's state once, and all-gather the updated rows;
        on a CPU, the heap guard's look (see [Note: the heap ratchet] in dspark.cpu_malloc)."""
        if heap_guard is not None:
            heap_guard.after_step()
        if step_count() == 0 and strategy.splits_optimizer_on(shard.size):
            agreed("checking the optimizer's state after its first step",  # one small gather, once
                   lambda: check_elementwise(optimizer, strategy=strategy.name, after_step=True))
        if strategy.splits_optimizer_on(shard.size) and not shard_params:
            reducer.gather_updated_rows()

    update = Update(optimizer, slots, shard_grads=strategy.shard_grads, loss_scaler=loss_scaler,
                    clip_grad_norm=config.clip_grad_norm, device=world.device, rank=rank, num_ranks=shard.size,
                    group=shard,
                    defer_host_reads=defer_host_reads, after_optimizer=after_optimizer,
                    skip_nonfinite=checks.skip_nonfinite, max_nonfinite_skips=checks.max_nonfinite_skips)
    frozen_slots = [s for s in all_slots if not s.requires_grad]
    # see [Note: a rank's optimizer state dict]
    optimizer_guard = (ShardedOptimizerGuard(optimizer, rank=rank, world_size=shard.size, strategy=strategy.name)
                       if strategy.splits_optimizer_on(shard.size) else None)
    states = StateDicts(model, slots, frozen_slots, optimizer, strategy=strategy, precision=precision,
                        loss_scaler=loss_scaler, zero3=zero3, guard=zero3_guard, world=world,
                        rank_groups=rank_groups, optimizer_guard=optimizer_guard)
    backward_pass = BackwardPass(
        slots=slots, frozen_params=[(names[0], p) for names, p in named if not p.requires_grad],
        window=window, reducer=reducer, zero3=zero3, loss_scaler=loss_scaler,
        grad_accum_steps=grad_accum_steps, shard_grads=strategy.shard_grads, world=world,
        step_count=step_count, allow_accum_scaled_loss=checks.allow_accum_scaled_loss,
        optimizer=optimizer, strategy=strategy.name)
    hooks: list[Any] = [s.param.register_post_accumulate_grad_hook(backward_pass.grad_ready_hook(s))
                        for s in slots]
    if optimizer_guard is not None:
        hooks.extend(optimizer_guard.handles)
    readers: list[Reader] = [window.count_forward, batch_check.record]
    if planned_micro_batch is not None:
        def planned_rows(inputs: ForwardInputs, args: Any, kwargs: Any) -> None:
            if model.training:  # first: a refused forward is not counted in the window
                check_planned_rows(inputs.rows, planned_micro_batch, grad_accum_steps)
        readers.insert(0, planned_rows)
    inputs = InputRecorder(  # see [Note: forward inputs]
        model, readers=readers, in_backward=lambda: window.in_backward,
        before_training_forward=None if buffer_sync is None else buffer_sync.before_forward)
    trace_dir, (warmup, active) = observation.trace_dir, observation.trace_steps
    trace = None if trace_dir is None else TraceSession(
        trace_dir, rank=rank, warmup=warmup, active=active, device=world.device)
    return EngineParts(
        slots=slots, rank_groups=rank_groups, frozen_slots=frozen_slots, shard_params=shard_params,
        batch_check=batch_check,
        batchnorms=batchnorms, zero3=zero3, zero3_guard=zero3_guard, optimizer=optimizer, reducer=reducer,
        update=update, states=states, backward_pass=backward_pass, hooks=hooks, inputs=inputs,
        observer=StepObserver(world.device, rank=rank, trace=trace, step_count=step_count))
