"""zero3: parameters live as shards and are gathered just in time.

[Note: units] A *unit* is a module whose parameters are gathered together: the root module, and every
module held in an ``nn.ModuleList`` / ``nn.Sequential`` (a model's repeated blocks), at any depth. A
parameter belongs to the units it sits under, minus nested units; so the root unit holds what no block
claims (embeddings, heads) for the whole forward, which keeps functional uses such as a tied output
head working.

Lifecycle of one unit in a step:
  forward pre-hook   gather its parameters (waiting on a prefetch if one is in flight), then start
                     gathering the next unit of the previous forward's order (prefetch)
  forward post-hook  free its parameters; hook its outputs so that backward regathers them
  pre-backward       (the outputs' gradient arrived) gather again, prefetch the unit that ran before it
  post-accumulate    each parameter is freed as soon as its gradient is accumulated (autograd calls
                     that hook once all uses of the parameter are done)
Every gather is an all-gather started in the same order on every rank (same graph, same hooks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dspark import comm
from dspark.engine.param_slot import ParamSlot

__all__ = ["Zero3Scheduler", "unit_modules"]


class _Gather:
    """One all-gather of several parameters' shards, packed into one flat buffer.

    Rank ``r``'s segment of the output holds its shard of every parameter in order, so parameter
    ``i`` is the strided column ``out[:, off_i:off_i + shard_i]``; copying it out gives the full,
    padded parameter (``chunk * N`` rows)."""

    def __init__(self, slots: list[ParamSlot]) -> None:
        self.slots = slots
        send = torch.cat([_shard(s).reshape(-1) for s in slots])
        self.out = send.new_empty((slots[0].num_ranks, send.numel()))  # (N, sum of shards)
        self.handle: comm.Handle | None = comm.all_gather_into_tensor(self.out, send, async_op=True)
        for slot in slots:
            slot.pending = self

    def finish(self) -> None:
        if self.handle is None:
            return
        self.handle.wait()
        self.handle = None
        offset = 0
        for slot in self.slots:
            column = self.out[:, offset: offset + slot.shard_numel]
            offset += slot.shard_numel
            if slot.pending is self:
                slot.set_full(column.reshape(-1))
        del self.out


def _shard(slot: ParamSlot) -> torch.Tensor:
    if slot.padded_shard is None:
        raise AssertionError(f"{slot.name}: gather without a shard")
    return slot.padded_shard


class _Unit:
    def __init__(self, index: int, name: str, module: nn.Module, slots: list[ParamSlot]) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.slots = slots


def unit_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every unit, the root first (see [Note: units])."""
    units = [("", root)]
    for name, module in root.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child_name, child in module.named_children():
                if any(True for _ in child.parameters()):
                    units.append((f"{name}.{child_name}" if name else child_name, child))
    # deduplicate (a module can sit in two containers) while keeping order
    seen: set[int] = set()
    unique = []
    for name, module in units:
        if id(module) not in seen:
            seen.add(id(module))
            unique.append((name, module))
    return unique


class Zero3Scheduler:
    def __init__(self, root: nn.Module, slots: list[ParamSlot]) -> None:
        by_param = {id(s.param): s for s in slots}
        modules = unit_modules(root)
        unit_ids = {id(m) for _, m in modules}
        self.units: list[_Unit] = []
        for index, (name, module) in enumerate(modules):
            owned = self._owned_params(module, unit_ids)
            unit_slots = [by_param[id(p)] for p in owned if id(p) in by_param]
            self.units.append(_Unit(index, name, module, unit_slots))
        self._holders: dict[int, int] = {id(s): 0 for s in slots}
        self._slots = slots
        self._order: list[int] = []  # unit indices in the previous forward's order
        self._current_order: list[int] = []
        self._grad_done: set[int] = set()
        self._handles: list[Any] = []
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_forward_hook(unit)))
            self._handles.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))

    @staticmethod
    def _owned_params(module: nn.Module, unit_ids: set[int]) -> list[nn.Parameter]:
        """Parameters under ``module`` that no nested unit claims (tied ones may appear in several)."""
        params: list[nn.Parameter] = list(module.parameters(recurse=False))
        for child in module.children():
            if id(child) in unit_ids:
                continue
            params.extend(Zero3Scheduler._owned_params(child, unit_ids))
        seen: set[int] = set()
        return [p for p in params if not (id(p) in seen or seen.add(id(p)))]  # type: ignore[func-returns-value]

    # -- gathering -------------------------------------------------------------------------------
    def _start(self, slots: Iterable[ParamSlot]) -> None:
        """Launch one batched all-gather for the slots that are neither gathered nor in flight."""
        todo = [s for s in slots if not s.gathered and s.pending is None and id(s) not in self._grad_done]
        if todo:
            _Gather(todo)

    def _gather(self, slots: Iterable[ParamSlot]) -> None:
        slots = list(slots)
        self._start(slots)
        for slot in slots:
            if slot.pending is not None:
                slot.pending.finish()

    def _prefetch(self, unit_index: int | None) -> None:
        if unit_index is not None:
            self._start(self.units[unit_index].slots)

    def _neighbour(self, unit: _Unit, step: int) -> int | None:
        if unit.index not in self._order:
            return None
        pos = self._order.index(unit.index) + step
        return self._order[pos] if 0 <= pos < len(self._order) else None

    # -- hooks -----------------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: _Unit) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if unit.index == 0:
                self._current_order = []
            self._current_order.append(unit.index)
            for slot in unit.slots:
                self._holders[id(slot)] += 1
            self._gather(unit.slots)
            self._prefetch(self._neighbour(unit, +1))
        return hook

    def _post_forward_hook(self, unit: _Unit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for slot in unit.slots:
                self._holders[id(slot)] -= 1
                if self._holders[id(slot)] == 0 and slot.gathered:
                    slot.free_full()
            if unit.index == 0:
                self._order = self._current_order
            if torch.is_grad_enabled() and unit.slots:
                fired = [False]

                def pre_backward(grad: torch.Tensor) -> None:
                    if not fired[0]:
                        fired[0] = True
                        self._gather(unit.slots)
                        self._prefetch(self._neighbour(unit, -1))

                for leaf in tree_leaves(output):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        leaf.register_hook(pre_backward)
        return hook

    def on_grad_accumulated(self, slot: ParamSlot) -> None:
        """The parameter's gradient is complete for this backward: its full value is not needed."""
        self._grad_done.add(id(slot))
        if slot.pending is not None:
            slot.pending.finish()
        if slot.gathered:
            slot.free_full()

    def end_backward(self) -> None:
        """Free whatever is still gathered (or in flight) and reset for the next step."""
        for slot in self._slots:
            if slot.pending is not None:
                slot.pending.finish()
            if slot.gathered:
                slot.free_full()
            self._holders[id(slot)] = 0
        self._grad_done.clear()

    def gather_all(self) -> None:
        self._gather(self._slots)

    def free_all(self) -> None:
        for slot in self._slots:
            if slot.gathered:
                slot.free_full()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
