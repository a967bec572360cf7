"""zero3: parameters live as shards and are gathered just in time.

Units, the modules gathered together, are planned in :mod:`dspark.engine.zero3_plan`
(see [Note: units]); each gather and its tag check is :mod:`dspark.engine.zero3_gather`; what
autograd saves of a parameter is kept by reference (:mod:`dspark.engine.zero3_saved`). This module
runs them: the hooks that gather and free each unit, and prefetching.

Lifecycle of one unit in a step:
  forward pre-hook   gather its parameters (waiting on a prefetch if one is in flight), then start
                     gathering the next unit of the previous forward's order (prefetch)
  forward post-hook  free its parameters (the root's own too); hook its outputs so that backward
                     regathers them
  pre-backward       (the outputs' gradient arrived) gather again, prefetch the unit that ran before it
                     (for the root: the last unit, which backward reaches next)
  post-accumulate    each trainable parameter is freed as soon as its gradient is complete
  post-backward      (units with frozen parameters) free them once the unit's inputs got their gradients

[Note: frozen parameters in backward] Backward reads a frozen parameter only through what autograd
saved of it (a frozen layer between trainable ones: the gradient of its input needs its weight); a
frozen parameter nothing saved (an embedding, or any layer whose inputs need no gradient) is not
read at all. So backward regathers a unit's trainable parameters and the frozen ones a saved tensor
was packed from (:attr:`dspark.engine.zero3_saved.SavedParams.packed`), and no other: a frozen
embedding in the root was otherwise gathered a second time at the start of every backward, for
nothing (the zoo's ``frozen`` model: its embedding is most of the model).
[Note: the root after forward] The root frees its own parameters after forward like every unit,
and regathers them when the gradient reaches its outputs, which is after the loss's own backward. A
language model's activation peak is that loss backward (the logits, their log-softmax and its
gradient: three tensors of batch x tokens x vocabulary), so a root kept whole from forward into
backward, or a last unit prefetched at the end of forward, sat on top of the peak: GPT-2 124M's
tied embedding, the largest tensor it has, and a block gather with its send buffer. The price is one
gather that
nothing overlaps, the root's, at the start of backward.

[Note: prefetch depth] A unit's gather is started while the unit before it runs, so a rank waits
at a unit only when its peer is more than one unit behind. Small units run for a few milliseconds:
a peer late by one unit's compute (a CPU rank's core taken for a moment, a slower kernel) then
stalls the other rank at every gather. So the unit after next is started too when it holds at most
:data:`SECOND_PREFETCH_MAX_BYTES` of parameters (whole): resnet50-cpu's small units gain from it,
gpt2-cpu's (5 units, each far more compute) do not (``dspark run --nproc 2 benchmarks/side_by_side.py
--workload resnet50-cpu --pairs zero3:replicate --steps 30`` measures zero3's step against
replicate's in the same processes, with one unit ahead or two). Larger units keep one unit ahead, as
FSDP does: their compute hides more, and a second one gathered would add to the memory peak
(GPT-2 124M's blocks stay at one).

A forward that runs *during* backward is a recomputation (activation checkpointing): it gathers what it
needs and frees nothing, the gradients that follow free the parameters. Every gather is an all-gather
per dtype, started in the same order on every rank (same graph, same hooks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dspark import comm
from dspark.engine.compile_boundary import outside_compile
from dspark.engine.param_slot import ParamSlot
from dspark.engine.zero3_gather import PURPOSES, Gather, GatherTags
from dspark.engine.zero3_generate import SyncedGenerate
from dspark.engine.zero3_plan import Zero3Unit, loose_modules, plan_units
from dspark.engine.zero3_saved import SavedParams
from dspark.errors import CollectiveTimeoutError
from dspark.policy.units import (
    MIN_NESTED_UNIT_BYTES,
    SECOND_PREFETCH_MAX_BYTES,
    UnitPolicy,
    unit_modules,
)
from dspark.tensor.batch import batch_leaves, map_batch

# the unit rule's names (dspark.policy.units), re-exported: the engine's callers reach zero3 here
__all__ = ["MIN_NESTED_UNIT_BYTES", "SECOND_PREFETCH_MAX_BYTES", "UnitPolicy", "Zero3Scheduler",
           "unit_modules"]



def _refuse_freed_call(name: str, slots: list[ParamSlot], unit: Zero3Unit) -> Callable[..., None]:
    """A forward pre-hook for a module that is not a unit but holds parameters: called while its
    unit is not running (``engine.module.head(h)`` in the user's code, outside ``engine(x)``), its
    parameters are freed, and PyTorch's error would be a bare shape mismatch."""
    def hook(module: nn.Module, args: Any) -> None:
        for slot in slots:
            if not slot.gathered:
                owner = (f"the unit engine.module.{unit.name}, whole only while its forward runs"
                         if unit.name else "the root unit, whole only while engine(...) runs")
                raise RuntimeError(
                    f"zero3: engine.module.{name} was called while its parameters are freed "
                    f"({slot.name} holds this rank's rows only); they belong to {owner}. Call it "
                    f"from the model's forward, through engine(...); or make it a unit of its own "
                    f"(zero3_units=, e.g. a predicate that also returns True for {name!r}), so that "
                    "calling it gathers its parameters, a collective every rank must join; for its "
                    "weights, engine.full_state_dict(); or train with strategy='zero2'")
    return hook


def _world_rank(group: comm.Group | None) -> Callable[[int], int]:
    """A gather's rank -> the world's: a shard group holds consecutive ranks (see [Note: hybrid
    sharding] in :mod:`dspark.policy.rank_groups`)."""
    if group is None:
        return lambda r: r
    first = comm.get_world().rank - group.rank
    return lambda r: first + r


class _AfterUnitBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.callback()
        return (None, *grads)


class Zero3Scheduler:
    """Gathers and frees zero3's units around their forward and backward (the lifecycle above), and
    the parameters the engine's own calls need whole (:meth:`gather_slots`)."""

    def __init__(self, root: nn.Module, slots: list[ParamSlot], *, policy: UnitPolicy = None,
                 in_backward: Callable[[], bool], window: Callable[[], int] = lambda: 0,
                 group: comm.Group | None = None) -> None:
        # the engine has sharded the parameters by now: their whole sizes come from their slots
        self.units = plan_units(root, slots, policy)
        self._in_backward = in_backward
        self._group = group  # the ranks sharing each parameter's rows (None: the world)
        self.tags = GatherTags(slots, in_backward=in_backward, window=window, ranks=_world_rank(group))
        """What each gather's tag says, and their check (see [Note: gather tags])."""
        self.saved = SavedParams(self._gather)
        """Saved views of gathered parameters kept by reference (see [Note: saved parameters])."""
        self._holders: dict[int, int] = {id(s): 0 for s in slots}
        self._slots = slots
        self._order: list[int] = []  # unit indices in the previous forward's order
        self._current_order: list[int] = []
        self._grad_done: set[int] = set()
        self._handles: list[Any] = []
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(
                self._pre_forward_hook(unit), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))
        for name, module, own, owner in loose_modules(root, self.units, slots):
            self._handles.append(module.register_forward_pre_hook(_refuse_freed_call(name, own, owner)))
        self._generate = SyncedGenerate(root, self.holding_root)  # see [Note: generation under zero3]

    @property
    def slots(self) -> list[ParamSlot]:
        """Every slot the scheduler gathers and frees, frozen ones included."""
        return self._slots

    def saving_parameters_by_reference(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context a forward runs in so that autograd does not keep freed parameters alive
        (see [Note: saved parameters])."""
        return self.saved.hooks()

    def largest_unit_bytes(self) -> int:
        return max((sum(s.numel * s.param.element_size() for s in u.slots) for u in self.units), default=0)

    # -- gathering -------------------------------------------------------------------------------
    def _start(self, slots: Iterable[ParamSlot], *, prefetch: bool = False, backward: bool = False,
               label: str = "dspark.gather") -> None:
        """Launch one all-gather per dtype for the slots that are neither gathered nor in flight (a
        prefetch also skips those whose gradient is complete: backward needs them no more; for
        ``backward``, frozen ones nothing saved: see [Note: frozen parameters in backward])."""
        by_dtype: dict[torch.dtype, list[ParamSlot]] = {}
        for s in slots:
            if s.gathered or s.pending is not None or (prefetch and id(s) in self._grad_done):
                continue
            # the parameter's own flag, not the slot's: one unfrozen since must reach its check whole
            if backward and not s.param.requires_grad and id(s) not in self.saved.packed:
                continue
            by_dtype.setdefault(s.dtype, []).append(s)
        for group in by_dtype.values():
            Gather(group, label, self.saved.installed, self.tags.tag(group), self.tags.check, self._group)

    def _gather(self, slots: Iterable[ParamSlot], label: str = "dspark.gather", *, backward: bool = False) -> None:
        slots = list(slots)
        self._start(slots, label=label, backward=backward)
        for slot in slots:
            if slot.pending is not None:
                slot.pending.finish()

    def _prefetch(self, unit_index: int | None, after: int | None = None, *, backward: bool = False) -> None:
        """Start gathering unit ``unit_index``, and unit ``after`` (the one that runs next after it)
        too when it is small (see [Note: prefetch depth])."""
        if unit_index is not None:
            unit = self.units[unit_index]
            self._start(unit.slots, prefetch=True, backward=backward, label=unit.label)
        if after is not None and self.units[after].whole_bytes <= SECOND_PREFETCH_MAX_BYTES:
            unit = self.units[after]
            self._start(unit.slots, prefetch=True, backward=backward, label=unit.label)

    def _next_two(self, unit: Zero3Unit, step: int) -> tuple[int | None, int | None]:
        """The units that run next after ``unit`` in the previous forward's order (``step=+1``) or
        before it (``step=-1``, backward's order): the first and the second, None past either end."""
        if unit.index not in self._order:
            return None, None
        pos = self._order.index(unit.index)
        first, second = pos + step, pos + 2 * step
        return (self._order[first] if 0 <= first < len(self._order) else None,
                self._order[second] if 0 <= second < len(self._order) else None)

    def _free(self, slots: Iterable[ParamSlot]) -> None:
        for slot in slots:
            if slot.pending is not None:
                slot.pending.finish()
            if slot.gathered and self._holders[id(slot)] == 0:
                slot.free_full()

    # -- hooks -----------------------------------------------------------------------------------
    # Both run outside any torch.compile graph: a compiled model is split at unit boundaries (each
    # unit's forward compiled on its own), because gathering and freeing swap parameter storage,
    # which a graph traced across units cannot follow.
    def _pre_forward_hook(self, unit: Zero3Unit) -> Any:
        @outside_compile
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if self._in_backward():  # recomputation: gather, free nothing (gradients will)
                self._gather(unit.slots, unit.label)
                return None
            if unit.index == 0:
                self._current_order = []
            self._current_order.append(unit.index)
            for slot in unit.slots:
                self._holders[id(slot)] += 1
            self._gather(unit.slots, unit.label)
            self._prefetch(*self._next_two(unit, +1))
            if unit.frozen and torch.is_grad_enabled():
                return self._wrap_inputs(unit, args, kwargs)
            return None
        return hook

    def _wrap_inputs(self, unit: Zero3Unit, args: Any, kwargs: Any) -> Any:
        inputs = [t for t in batch_leaves((args, kwargs)) if t.requires_grad]
        if not inputs:
            return None
        wrapped = iter(_AfterUnitBackward.apply(lambda: self._free(unit.frozen), *inputs))
        return map_batch((args, kwargs), lambda t: next(wrapped) if t.requires_grad else t)

    def _post_forward_hook(self, unit: Zero3Unit) -> Any:
        @outside_compile
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._in_backward():
                return
            for slot in unit.slots:
                self._holders[id(slot)] -= 1
            grad_enabled = torch.is_grad_enabled()
            if unit.index == 0:
                self._order = self._current_order
            # The root too: see [Note: the root after forward].
            self._free(unit.slots)
            if grad_enabled and (unit.slots or unit.index == 0):
                fired = [False]

                def pre_backward(grad: torch.Tensor) -> None:
                    if not fired[0]:
                        fired[0] = True
                        self._gather(unit.slots, unit.label, backward=True)
                        # backward reaches the root's own parameters (the head) first, then the
                        # last unit; every other unit, then the one that ran before it
                        if unit.index == 0:
                            order = self._order
                            self._prefetch(order[-1] if order else None,
                                           order[-2] if len(order) > 2 else None, backward=True)
                        else:
                            self._prefetch(*self._next_two(unit, -1), backward=True)

                for leaf in batch_leaves(output):
                    if leaf.requires_grad:
                        leaf.register_hook(pre_backward)
        return hook

    def on_grad_accumulated(self, slot: ParamSlot) -> None:
        """A gradient was accumulated into the parameter; once it is complete the full value is not
        needed any more."""
        if not slot.grad_complete:
            return
        self._grad_done.add(id(slot))
        if slot.pending is not None:
            slot.pending.finish()
        if slot.gathered:
            slot.free_full()

    def end_backward(self) -> None:
        """Free whatever is still gathered (or in flight), check the deferred gather tags and reset
        for the next step."""
        try:
            for slot in self._slots:
                if slot.pending is not None:
                    slot.pending.finish()
        finally:
            for slot in self._slots:
                slot.pending = None
                if slot.gathered:
                    slot.free_full()
                self._holders[id(slot)] = 0
            self._grad_done.clear()
            self.saved.installed.clear()  # every storage it named is freed now
            self.saved.packed.clear()
        self.tags.verify_deferred()

    def after_failed_forward(self, exc: RuntimeError) -> RuntimeError | None:
        """A forward failed: free what it left half-gathered, and explain a shape error that an empty
        (freed) parameter read outside its unit causes; None when ``exc`` is not one."""
        freed = [s.name for s in self._slots if s.requires_grad and not s.gathered]
        try:
            self.end_backward()  # a failed forward leaves units half-gathered: start clean
        except CollectiveTimeoutError:
            if not isinstance(exc, CollectiveTimeoutError):
                raise
            return None  # the forward's own timeout is the error; the cleanup's refusal only repeats it
        if "shape" not in str(exc) and "size" not in str(exc):
            return None
        return RuntimeError(
            f"{exc}\n[DSpark zero3] parameters are whole only while the unit that owns them runs "
            f"its forward (units are the children of nn.ModuleList/nn.Sequential, or those chosen "
            f"with zero3_units=; the root owns the rest). A parameter read outside its unit, e.g. by "
            f"the parent's forward, is an empty tensor there; freed now: {', '.join(freed[:5])}"
            f"{' ...' if len(freed) > 5 else ''}. Move that use into the unit's forward, or use "
            "strategy='zero2'.")

    def gather_slots(self, slots: Iterable[ParamSlot], *, purpose: str | None = None) -> None:
        """Gather ``slots`` now; ``purpose``: the engine call gathering them (one of
        :data:`~dspark.engine.zero3_gather.PURPOSES`, e.g. ``"full_state_dict"``), which the tags and
        the collective's label then name."""
        if purpose is None:
            self._gather(slots)
            return
        self.tags.activity = 4 + PURPOSES.index(purpose)
        try:
            self._gather(slots, label=f"dspark.{purpose}.gather")
        finally:
            self.tags.activity = None

    @contextlib.contextmanager
    def holding_root(self) -> Iterator[None]:
        """Keep the root unit gathered for the duration, however many forwards run inside (see [Note:
        generation under zero3]); its gather is tagged like a forward's."""
        root = self.units[0]
        for slot in root.slots:
            self._holders[id(slot)] += 1
        try:
            self._gather(root.slots, root.label)
            yield
        finally:
            for slot in root.slots:
                self._holders[id(slot)] -= 1
            self._free(root.slots)

    def free_slots(self, slots: Iterable[ParamSlot]) -> None:
        for slot in slots:
            if slot.gathered:
                slot.free_full()

    def gather_all(self) -> None:
        self._gather(self._slots)

    def free_all(self) -> None:
        self.free_slots(self._slots)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._generate.remove()
