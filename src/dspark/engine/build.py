"""Building the engine's pieces on each rank: the model placed on its device (equal to rank 0's,
materialised from the meta device if need be, zero3 keeping only this rank's rows) and the optimizer
built by the user's factory over the tensors the engine updates."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dspark.comm import World
from dspark.engine.buffer_sync import broadcast_tensors
from dspark.engine.materialize import has_meta_tensors, materialize
from dspark.engine.optimizer_kernel import prefer_fused_kernel
from dspark.engine.param_slot import ParamSlot
from dspark.engine.policy import ShardingPolicy
from dspark.engine.validation import warn_unknown_group_options
from dspark.engine.zero3_guard import Zero3StateDictGuard
from dspark.engine.zero3_units import UnitPolicy, Zero3Scheduler

__all__ = ["OptimizerFactory", "build_optimizer", "place_model", "shard_parameters"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def place_model(model: nn.Module, named: Sequence[tuple[list[str], nn.Parameter]], slot_of: dict[int, ParamSlot],
                *, world: World, shard_params: bool) -> None:
    """Give ``model`` real storage on this rank's device, equal to rank 0's, and a slot in ``slot_of``
    (by ``id``) for each parameter the engine manages: the trainable ones, and under zero3 (which keeps
    only this rank's rows of each parameter) the frozen ones too. ``named``: :func:`unique_params`."""
    rank, n, device = world.rank, world.world_size, world.device
    names_of = {id(p): names for names, p in named}

    def keep(p: nn.Parameter) -> None:
        if not (shard_params or p.requires_grad):
            return
        slot = ParamSlot(names_of[id(p)], p, rank=rank, num_ranks=n)
        slot_of[id(p)] = slot
        if shard_params:
            slot.shard_and_free_full()

    if has_meta_tensors(model):
        def on_final(name: str, p: nn.Parameter) -> None:
            if n > 1:
                # rank 0's values, whatever each rank's seed
                broadcast_tensors([p.data], label="dspark.construction.broadcast")
            keep(p)

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
                     policy: UnitPolicy, in_backward: Callable[[], bool], window: Callable[[], int]
                     ) -> tuple[Zero3Scheduler | None, Zero3StateDictGuard | None]:
    """zero3 on several ranks: the scheduler that gathers each unit's parameters just in time, and
    the guard that keeps ``model.state_dict()`` from returning freed (empty) tensors (see [Note:
    state dicts under zero3]). Elsewhere a rank's shard of a parameter is the whole parameter."""
    if strategy.shard_params and world.world_size > 1:
        return (Zero3Scheduler(model, list(slots), policy=policy, in_backward=in_backward, window=window),
                Zero3StateDictGuard(model, slots, rank=world.rank))
    if strategy.shard_optimizer:  # zero1/zero2 (and zero3 on one rank) keep the parameter in place
        for slot in slots:
            if slot.requires_grad:
                slot.view_shard_of_full()
    return None, None
