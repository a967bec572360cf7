"""The engine's sharded state dict: the boundary between the engine and anything that saves it.

[Note: sharded state dict] ``engine.sharded_state_dict()`` describes everything the engine holds, as
PyTorch's distributed checkpoint (DCP) consumes it, with live tensors (no copies)::

    {"model":     {name: tensor or DTensor},              # every parameter (in its rows view: a
                                                           #   0-d one as shape (1,)), every buffer
     "optimizer": {"state": {name: {key: tensor, DTensor or value}},
                   "param_groups": [{"params": [names], "lr": ..., ...}]},
     "engine":    {"step_count", "loss_scale", "loss_scale_good_steps", "strategy", "precision",
                   "world_size", "optimizer", "aliases": {name: [other names of a tied parameter]},
                   "params": {trainable parameter name: its rows-view shape},
                   "scalar_params": [parameters that are 0-d in the model]}}

What a rank holds only rows of is a ``Shard(0)`` DTensor over the global shape (zero3 parameters,
the optimizer state of zero1/2/3); what every rank holds whole is a plain tensor. A tied parameter
appears once, under its first name. ``engine.load_sharded_state_dict(sd)`` takes the same structure
back (tensors holding this rank's rows, or whole tensors), whatever world size and strategy wrote it,
so ``dcp.save(engine.sharded_state_dict(), ...)`` and ``dcp.load`` into it work directly; DSpark's own
checkpoints (``engine.save``/``engine.load``, :mod:`dspark.checkpoint`) work only through it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dspark import comm
from dspark.engine.param_slot import ParamSlot
from dspark.tensor import DistTensor, Shard

if TYPE_CHECKING:
    from dspark.engine.engine import Engine

__all__ = ["is_per_element", "load_sharded_state_dict", "rows_shape", "sharded_state_dict"]


def rows_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A parameter's shape as it is split along dim 0: 0-d parameters count as one row.

    Example::

        rows_shape(())      # (1,)
        rows_shape((7, 2))  # (7, 2)
    """
    return tuple(int(s) for s in shape) if len(shape) else (1,)


def is_per_element(state_key: str, value_shape: Sequence[int], param_shape: Sequence[int]) -> bool:
    """Whether an optimizer-state tensor holds one value per parameter element (and so is sharded like
    the parameter) rather than a scalar for the whole parameter. A 0-d parameter makes that
    ambiguous (its exp_avg and its ``step`` are both 0-d); there ``step`` is the scalar.

    Example::

        is_per_element("exp_avg", (7, 2), (7, 2))   # True
        is_per_element("step", (), ())              # False
    """
    if tuple(value_shape) != tuple(param_shape):
        return False
    return len(param_shape) > 0 or state_key != "step"


def _dcp(local: torch.Tensor, global_shape: Sequence[int], *, sharded: bool) -> Any:
    """``local`` as DCP sees it: this rank's rows as a Shard(0) DTensor, or the whole tensor."""
    if not sharded or comm.get_world().world_size == 1:
        return local
    return DistTensor(local, Shard(0), tuple(global_shape)).to_dtensor()


def _local(value: Any) -> torch.Tensor:
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value  # type: ignore[no-any-return]


def _opt_param(engine: Engine, slot: ParamSlot) -> nn.Parameter | None:
    return slot.opt_param if engine.strategy.shard_optimizer else slot.param


def sharded_state_dict(engine: Engine) -> dict[str, Any]:
    """See [Note: sharded state dict]."""
    model: dict[str, Any] = {}
    slots = [*engine.slots, *engine._frozen_slots]
    slot_names = {name for slot in slots for name in slot.names}
    for slot in slots:
        if slot.padded_shard is not None:  # zero3 on several ranks: rows only
            model[slot.name] = _dcp(slot.padded_shard[: slot.local_rows], rows_shape(slot.shape), sharded=True)
        else:
            model[slot.name] = slot.rows_view(slot.param.detach())
    params = dict(engine.module.named_parameters())
    # a parameter's shape in the model (under zero3 a freed parameter's tensor is empty: its slot says)
    params_shape = {name: tuple(p.shape) for name, p in params.items()}
    params_shape.update({s.name: tuple(s.shape) for s in slots})
    for name, tensor in engine._module_state_dict().items():
        if name in slot_names:
            continue
        value = tensor.detach()
        model[name] = value.reshape(1) if name in params and value.dim() == 0 else value

    optimizer = engine.optimizer
    sharded = engine.strategy.shard_optimizer
    state: dict[str, dict[str, Any]] = {}
    names_of = {id(_opt_param(engine, s)): s.name for s in engine.slots}
    slot_of = {s.name: s for s in engine.slots}
    for param, values in optimizer.state.items():
        owner = names_of.get(id(param))
        if owner is None:
            continue
        slot = slot_of[owner]
        entry: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and is_per_element(str(key), value.shape, param.shape):
                local = value.detach().reshape(slot.opt_shape if sharded else rows_shape(slot.shape))
                entry[str(key)] = _dcp(local, rows_shape(slot.shape), sharded=sharded)
            else:
                entry[str(key)] = value.detach() if isinstance(value, torch.Tensor) else value
        state[owner] = entry
    groups = []
    for group in optimizer.param_groups:
        members = [names_of[id(p)] for p in group["params"] if id(p) in names_of]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
    scaler = engine.loss_scaler
    return {
        "model": model,
        "optimizer": {"state": state, "param_groups": groups},
        "engine": {
            "step_count": engine.step_count,
            "loss_scale": None if scaler is None else float(scaler.scale),
            "loss_scale_good_steps": None if scaler is None else int(scaler.good_steps),
            "strategy": engine.strategy.name,
            "precision": engine.precision.name,
            "world_size": engine.world.world_size,
            "optimizer": type(optimizer).__name__,
            "aliases": {s.name: list(s.names[1:]) for s in slots if len(s.names) > 1},
            "params": {s.name: list(rows_shape(s.shape)) for s in engine.slots},
            "scalar_params": [name for name in model if name in params_shape and not params_shape[name]],
        },
    }


def load_sharded_state_dict(engine: Engine, state: Mapping[str, Any]) -> None:
    """Install ``state`` (the structure of [Note: sharded state dict]; parts may be missing) into the
    engine: each tensor holds this rank's rows or the whole tensor. Parameters and buffers are copied
    in place; optimizer state goes through the optimizer's own ``load_state_dict``; the engine
    section restores the step count and the fp16 loss scale."""
    if not isinstance(state, Mapping):
        raise TypeError(f"load_sharded_state_dict expects a mapping, got {type(state).__name__}")
    model = state.get("model", {})
    slots = [*engine.slots, *engine._frozen_slots]
    with torch.no_grad():
        for slot in slots:
            name = next((n for n in slot.names if n in model), None)
            if name is None:
                continue
            _install_param(slot, _local(model[name]), name)
        slot_names = {name for slot in slots for name in slot.names}
        for name, tensor in engine._module_state_dict().items():
            if name in slot_names or name not in model:
                continue
            value = _local(model[name])
            if value.numel() != tensor.numel():
                raise ValueError(f"{name!r} has {value.numel()} elements in the state dict but "
                                 f"{tensor.numel()} in the model")
            tensor.detach().copy_(value.reshape(tensor.shape))
    optimizer_state = state.get("optimizer")
    if optimizer_state is not None:
        _install_optimizer_state(engine, optimizer_state)
    meta = state.get("engine", {})
    if "step_count" in meta:
        engine.step_count = int(meta["step_count"])
    if engine.loss_scaler is not None and meta.get("loss_scale") is not None:
        engine.loss_scaler.scale = float(meta["loss_scale"])
        engine.loss_scaler.good_steps = int(meta.get("loss_scale_good_steps") or 0)


def _install_param(slot: ParamSlot, value: torch.Tensor, name: str) -> None:
    global_rows = rows_shape(slot.shape)
    if slot.padded_shard is not None:
        if tuple(value.shape) == global_rows and slot.local_rows != slot.rows:
            value = value[slot.start:slot.stop]  # a whole tensor: keep this rank's rows
        if tuple(value.shape) != rows_shape(slot.opt_shape) and value.numel() != slot.local_numel:
            raise ValueError(f"{name!r}: {tuple(value.shape)} in the state dict, this rank holds rows "
                             f"{slot.start}:{slot.stop} of {global_rows}")
        slot.padded_shard[: slot.local_rows].copy_(value.reshape(slot.padded_shard[: slot.local_rows].shape))
        return
    if value.numel() != slot.numel:
        raise ValueError(f"{name!r} has shape {tuple(value.shape)} in the state dict but {global_rows} "
                         "in the model (rows view)")
    slot.rows_view(slot.param.detach()).copy_(value.reshape(global_rows))


def _install_optimizer_state(engine: Engine, saved: Mapping[str, Any]) -> None:
    optimizer = engine.optimizer
    sharded = engine.strategy.shard_optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index_of = {id(p): i for i, p in enumerate(params)}
    saved_state = saved.get("state", {})
    per_param: dict[int, dict[str, Any]] = {}
    for slot in engine.slots:
        param = _opt_param(engine, slot)
        if param is None or id(param) not in index_of:
            continue  # no rows of it on this rank: the optimizer skips it
        values = next((saved_state[n] for n in slot.names if n in saved_state), None)
        if not values:
            continue
        entry: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) or hasattr(value, "to_local"):
                local = _local(value)
                if local.numel() == param.numel() and local.dim() > 0 and (
                        tuple(local.shape) == (slot.opt_shape if sharded else rows_shape(slot.shape))):
                    local = local.view(param.shape)  # the rows view back to the parameter's shape
                entry[key] = local
            else:
                entry[key] = value
        per_param[index_of[id(param)]] = entry
    current = optimizer.state_dict()["param_groups"]
    saved_groups = saved.get("param_groups") or [{} for _ in current]
    if len(saved_groups) != len(current):
        raise ValueError(f"the state dict has {len(saved_groups)} optimizer param group(s), this "
                         f"engine's optimizer {len(current)}: build the optimizer with the same groups "
                         "(the same param_groups function)")
    groups = [{**{k: v for k, v in s.items() if k != "params"}, "params": now["params"]}
              for s, now in zip(saved_groups, current, strict=True)]
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})
