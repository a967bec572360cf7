"""The engine's state dicts: the whole model's (``full_state_dict``; loading one is in
:mod:`dspark.engine.pretrained`) and the sharded one, the boundary between the engine and anything
that saves it.

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
the optimizer state of zero1/2/3); what every rank holds whole is a plain tensor. Under hybrid
sharding the DTensor lives on the 2-D ``(replica, shard)`` mesh with placements ``[Replicate(),
Shard(0)]``: the rows are split over the shard group and repeated across groups, so DCP writes each
row once (one copy of a shard, from one rank) and reads it back at any layout. A tied parameter
appears once, under its first name. ``engine.load_sharded_state_dict(sd)`` takes the same structure
back (tensors holding this rank's rows, or whole tensors), whatever world size and strategy wrote it,
so ``dcp.save(engine.sharded_state_dict(), ...)`` and ``dcp.load`` into it work directly; DSpark's own
checkpoints (``engine.save``/``engine.load``, :mod:`dspark.checkpoint`) work only through it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from dspark.comm import World
from dspark.engine.adapters import (
    adapter_layout,
    adapter_tensor_names,
    base_load_problem,
    holds_peft,
    merged_tensors,
    save_adapter,
)
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.optimizer_guard import ShardedOptimizerGuard
from dspark.engine.param_slot import SHARDED_STATES, ParamSlot
from dspark.engine.pretrained import Names, save_gathered, save_pretrained
from dspark.engine.rank_groups import RankGroups
from dspark.engine.weights import SavedTensor, WeightEntry, saved_as_is, weight_entries
from dspark.engine.zero3_guard import Zero3StateDictGuard
from dspark.engine.zero3_units import Zero3Scheduler
from dspark.policy.strategies import PrecisionPolicy, ShardingPolicy
from dspark.tensor import DistTensor, Shard
from dspark.tensor.shard_math import shard_range

__all__ = ["IncompatibleKeys", "StateDicts", "is_per_element", "rows_shape"]


class IncompatibleKeys(NamedTuple):
    """What :meth:`Engine.load_full_state_dict` did not match (as ``nn.Module.load_state_dict``)."""

    missing_keys: list[str]
    """Names of the model the state dict has no value for (left as they were)."""
    unexpected_keys: list[str]
    """Keys of the state dict that name nothing in the model (ignored)."""


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


def _local(value: Any) -> torch.Tensor:
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value  # type: ignore[no-any-return]


class StateDicts:
    """The engine's parameters, buffers and optimizer state as state dicts, read and written in place.
    ``slots`` are the trainable parameters, ``frozen_slots`` the frozen ones zero3 shards; ``zero3``
    and ``guard`` are there under zero3 on several ranks.

    Example::

        states = StateDicts(model, slots, frozen_slots, optimizer, strategy=STRATEGIES["zero2"],
                            precision=PRECISIONS["fp32"], loss_scaler=None, zero3=None, guard=None,
                            world=dspark.get_world())
        states.full(rank0_only=False, cpu=True)     # {name: tensor}, as model.state_dict()
    """

    def __init__(self, module: nn.Module, slots: Sequence[ParamSlot], frozen_slots: Sequence[ParamSlot],
                 optimizer: torch.optim.Optimizer, *, strategy: ShardingPolicy, precision: PrecisionPolicy,
                 loss_scaler: LossScaler | None, zero3: Zero3Scheduler | None,
                 guard: Zero3StateDictGuard | None, world: World, rank_groups: RankGroups | None = None,
                 optimizer_guard: ShardedOptimizerGuard | None = None) -> None:
        self.module = module
        self.slots = list(slots)
        self.frozen_slots = list(frozen_slots)
        self.optimizer = optimizer
        self.strategy = strategy
        self.shard_optimizer = strategy.shard_optimizer
        self.precision = precision
        self.loss_scaler = loss_scaler
        self.zero3 = zero3
        self.guard = guard
        self.optimizer_guard = optimizer_guard
        self.world = world
        self.rank_groups = rank_groups
        """Where a sharded tensor's rows are split (None: over the world)."""
        self.rank = world.rank

    def weight_entries(self) -> list[WeightEntry]:
        """The model's tensors as this rank holds them (see :mod:`dspark.engine.weights`)."""
        return weight_entries([*self.slots, *self.frozen_slots], self.module_state_dict())

    def module_state_dict(self) -> dict[str, Any]:
        """``module.state_dict(keep_vars=True)`` for walks over names and buffers: under zero3 the
        module refuses it while its parameters are freed (see [Note: state dicts under zero3]); the
        parameters' entries here are then empty and must not be read."""
        with self._names_only():
            return self.module.state_dict(keep_vars=True)

    def _opt_param(self, slot: ParamSlot) -> nn.Parameter | None:
        return slot.opt_param if self.shard_optimizer else slot.param

    # -- the whole model -------------------------------------------------------------------------
    def full(self, *, rank0_only: bool, cpu: bool) -> dict[str, torch.Tensor]:
        """See :meth:`Engine.full_state_dict` (buffers already synchronised)."""
        keep = not rank0_only or self.rank == 0

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True) if cpu else t.detach().clone()

        values: dict[str, torch.Tensor] = {}
        if self.zero3 is not None:
            for unit in self.zero3.units:
                todo = [s for s in unit.slots if s.names[0] not in values]
                self.zero3.gather_slots(todo, purpose="full_state_dict")
                if keep:
                    for slot in todo:
                        for name in slot.names:
                            values[name] = own(slot.param)
                self.zero3.free_slots(todo)
        if not keep:
            return {}
        out: dict[str, torch.Tensor] = {}
        for name, value in self.module_state_dict().items():
            out[name] = values[name] if name in values else own(value)
        return out

    def save_pretrained(self, directory: str | os.PathLike[str], *, max_shard_size: int | str,
                        config: Any, merged: bool) -> Path:
        """See :meth:`Engine.save_pretrained` (buffers already synchronised): zero3 gathers one unit
        at a time; a peft model's adapter as peft saves it, or the merged model."""
        zero3 = self.zero3
        gathering: dict[str, Any] = {
            "units": [unit.slots for unit in zero3.units] if zero3 is not None else [],
            "gather": functools.partial(zero3.gather_slots, purpose="save_pretrained") if zero3 is not None else None,
            "free": zero3.free_slots if zero3 is not None else None}
        entries = self.weight_entries()
        layout = adapter_layout(self.module, [n for e in entries for n in e.names])
        if layout is None:
            if merged:
                raise ValueError(f"save_pretrained(merged=True) merges a peft model's adapters; this "
                                 f"{type(self.module).__name__} holds none: save it with merged=False")
            return save_pretrained(saved_as_is(entries), directory, max_shard_size=max_shard_size, config=config,
                                   **gathering)
        if merged:
            return save_pretrained(merged_tensors(layout, entries), directory, max_shard_size=max_shard_size,
                                   config=config, **gathering)
        if not layout.is_peft_model:
            raise ValueError(f"{type(self.module).__name__} holds peft adapters but is not a peft.PeftModel, "
                             "so DSpark cannot write the adapter as peft does: wrap the model with "
                             "peft.get_peft_model, or save the merged model (merged=True)")
        # peft reads module.state_dict() for names only: allowed under zero3 (see [Note: state dicts
        # under zero3]); the values it writes are the gathered ones handed to it
        with self._names_only():
            needed = set(adapter_tensor_names(self.module, {n: (e.shape, e.dtype) for e in entries for n in e.names}))
        adapter = [SavedTensor(name, e.shape, e.dtype, (e,), e.full)
                   for e in entries for name in e.names if name in needed]

        def write(out: Path, state_dict: dict[str, torch.Tensor]) -> None:
            with self._names_only():
                save_adapter(self.module, out, state_dict)

        return save_gathered(adapter, directory, write, **gathering)

    def _names_only(self) -> contextlib.AbstractContextManager[None]:
        return self.guard.allowed() if self.guard is not None else contextlib.nullcontext()

    def hf_config(self) -> Any:
        """The model's HuggingFace config, which checkpoints keep as ``config.json``; None without one,
        and for a peft model, whose state-dict names are not its config's model's."""
        config = getattr(self.module, "config", None)
        if not callable(getattr(config, "to_json_string", None)) or holds_peft(self.module):
            return None
        return config

    def load_targets(self) -> tuple[list[WeightEntry], Names | None]:
        """What weights load into: the entries, and a peft model's other names for them (see [Note:
        peft names] in :mod:`dspark.engine.adapters`): its base model's names, and the adapter's own
        tensors as optional."""
        entries = self.weight_entries()
        layout = adapter_layout(self.module, [n for e in entries for n in e.names])
        if layout is None:
            return entries, None
        return entries, {"aliases": layout.sources(tied=[e.names for e in entries]), "optional": layout.adapter,
                         "alias_problem": base_load_problem(self.module)}

    # -- sharded ---------------------------------------------------------------------------------
    def _dcp(self, local: torch.Tensor, global_shape: Sequence[int], *, sharded: bool) -> Any:
        """``local`` as DCP sees it: this rank's rows as a Shard(0) DTensor (on the hybrid mesh where
        there is one), or the whole tensor."""
        groups = self.rank_groups
        split_over = self.world.world_size if groups is None else groups.shard_size
        if not sharded or split_over == 1:
            return local
        mesh = None if groups is None else groups.mesh()
        if mesh is None:
            return DistTensor(local, Shard(0), tuple(global_shape)).to_dtensor()
        from dspark.comm.dtensor_interop import to_torch_dtensor  # DTensor is heavy to import

        return to_torch_dtensor(local, 0, tuple(global_shape), mesh=mesh)

    def sharded(self, *, step_count: int) -> dict[str, Any]:
        """See [Note: sharded state dict]."""
        model: dict[str, Any] = {}
        slots = [*self.slots, *self.frozen_slots]
        slot_names = {name for slot in slots for name in slot.names}
        for slot in slots:
            if slot.state in SHARDED_STATES:  # zero3 on several ranks: rows only
                model[slot.name] = self._dcp(slot.held()[: slot.local_rows], rows_shape(slot.shape), sharded=True)
            else:
                model[slot.name] = slot.rows_view(slot.param.detach())
        params = dict(self.module.named_parameters())
        # a parameter's shape in the model (under zero3 a freed parameter's tensor is empty: its slot says)
        params_shape = {name: tuple(p.shape) for name, p in params.items()}
        params_shape.update({s.name: tuple(s.shape) for s in slots})
        for name, tensor in self.module_state_dict().items():
            if name in slot_names:
                continue
            value = tensor.detach()
            model[name] = value.reshape(1) if name in params and value.dim() == 0 else value

        optimizer = self.optimizer
        sharded = self.shard_optimizer
        state: dict[str, dict[str, Any]] = {}
        names_of = {id(self._opt_param(s)): s.name for s in self.slots}
        slot_of = {s.name: s for s in self.slots}
        for param, values in optimizer.state.items():
            owner = names_of.get(id(param))
            if owner is None:
                continue
            slot = slot_of[owner]
            entry: dict[str, Any] = {}
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and is_per_element(str(key), value.shape, param.shape):
                    local = value.detach().reshape(slot.opt_shape if sharded else rows_shape(slot.shape))
                    entry[str(key)] = self._dcp(local, rows_shape(slot.shape), sharded=sharded)
                else:
                    entry[str(key)] = value.detach() if isinstance(value, torch.Tensor) else value
            state[owner] = entry
        groups = []
        for group in optimizer.param_groups:
            members = [names_of[id(p)] for p in group["params"] if id(p) in names_of]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
        scaler = self.loss_scaler
        return {
            "model": model,
            "optimizer": {"state": state, "param_groups": groups},
            "engine": {
                "step_count": step_count,
                "loss_scale": None if scaler is None else float(scaler.scale),
                "loss_scale_good_steps": None if scaler is None else int(scaler.good_steps),
                "strategy": self.strategy.name,
                "precision": self.precision.name,
                "world_size": self.world.world_size,
                "optimizer": type(optimizer).__name__,
                "aliases": {s.name: list(s.names[1:]) for s in slots if len(s.names) > 1},
                "params": {s.name: list(rows_shape(s.shape)) for s in self.slots},
                "scalar_params": [name for name in model if name in params_shape and not params_shape[name]],
            },
        }

    def empty_shard(self, global_rows: Sequence[int], dtype: torch.dtype) -> Any:
        """See :meth:`Engine.empty_shard`."""
        groups = self.rank_groups
        rank, size = (self.world.rank, self.world.world_size) if groups is None else (
            groups.shard_rank, groups.shard_size)
        start, stop = shard_range(global_rows[0], size, rank)
        if stop <= start:
            return None
        local = torch.empty((stop - start, *global_rows[1:]), dtype=dtype)  # read on the CPU, as optimizers load it
        return self._dcp(local, global_rows, sharded=True)

    def load_sharded(self, state: Mapping[str, Any]) -> int | None:
        """Install ``state`` (the structure of [Note: sharded state dict]; parts may be missing): each
        tensor holds this rank's rows or the whole tensor. Parameters and buffers are copied in place;
        optimizer state goes through the optimizer's own ``load_state_dict``; the fp16 loss scale is
        restored. Returns the step count to restore, if the state has one."""
        if not isinstance(state, Mapping):
            raise TypeError(f"load_sharded_state_dict expects a mapping, got {type(state).__name__}")
        model = state.get("model", {})
        slots = [*self.slots, *self.frozen_slots]
        with torch.no_grad():
            for slot in slots:
                name = next((n for n in slot.names if n in model), None)
                if name is None:
                    continue
                _install_param(slot, _local(model[name]), name)
            slot_names = {name for slot in slots for name in slot.names}
            for name, tensor in self.module_state_dict().items():
                if name in slot_names or name not in model:
                    continue
                value = _local(model[name])
                if value.numel() != tensor.numel():
                    raise ValueError(f"{name!r} has {value.numel()} elements in the state dict but "
                                     f"{tensor.numel()} in the model")
                tensor.detach().copy_(value.reshape(tensor.shape))
        optimizer_state = state.get("optimizer")
        if optimizer_state is not None:
            self._install_optimizer_state(optimizer_state)
        meta = state.get("engine", {})
        if self.loss_scaler is not None and meta.get("loss_scale") is not None:
            self.loss_scaler.scale = float(meta["loss_scale"])
            self.loss_scaler.good_steps = int(meta.get("loss_scale_good_steps") or 0)
        return int(meta["step_count"]) if "step_count" in meta else None

    def _install_optimizer_state(self, saved: Mapping[str, Any]) -> None:
        optimizer = self.optimizer
        sharded = self.shard_optimizer
        params = [p for g in optimizer.param_groups for p in g["params"]]
        index_of = {id(p): i for i, p in enumerate(params)}
        saved_state = saved.get("state", {})
        per_param: dict[int, dict[str, Any]] = {}
        for slot in self.slots:
            param = self._opt_param(slot)
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
        current = optimizer.param_groups
        saved_groups = saved.get("param_groups") or [{} for _ in current]
        if len(saved_groups) != len(current):
            raise ValueError(f"the state dict has {len(saved_groups)} optimizer param group(s), this "
                             f"engine's optimizer {len(current)}: build the optimizer with the same groups "
                             "(the same param_groups function)")
        groups: list[dict[str, Any]] = []
        first = 0
        for s, now in zip(saved_groups, current, strict=True):  # params by index, as state_dict() packs them
            groups.append({**{k: v for k, v in s.items() if k != "params"},
                           "params": list(range(first, first + len(now["params"])))})
            first += len(now["params"])
        guard = self.optimizer_guard
        with contextlib.nullcontext() if guard is None else guard.allowed():
            optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def _install_param(slot: ParamSlot, value: torch.Tensor, name: str) -> None:
    global_rows = rows_shape(slot.shape)
    if slot.state in SHARDED_STATES:
        if tuple(value.shape) == global_rows and slot.local_rows != slot.rows:
            value = value[slot.start:slot.stop]  # a whole tensor: keep this rank's rows
        if tuple(value.shape) != rows_shape(slot.opt_shape) and value.numel() != slot.local_numel:
            raise ValueError(f"{name!r}: {tuple(value.shape)} in the state dict, this rank holds rows "
                             f"{slot.start}:{slot.stop} of {global_rows}")
        local = slot.held()[: slot.local_rows]
        local.copy_(value.reshape(local.shape))
        return
    if value.numel() != slot.numel:
        raise ValueError(f"{name!r} has shape {tuple(value.shape)} in the state dict but {global_rows} "
                         "in the model (rows view)")
    slot.rows_view(slot.param.detach()).copy_(value.reshape(global_rows))
