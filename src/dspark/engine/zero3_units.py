"""zero3: parameters live as shards and are gathered just in time.

[Note: units] A *unit* is a module whose parameters are gathered together: the root module, and by
default every module held in an ``nn.ModuleList`` / ``nn.Sequential`` (a model's repeated blocks);
one nested inside another such unit only when it holds at least :data:`MIN_NESTED_UNIT_BYTES` of
parameters. Every gather is a collective, whose latency a few kilobytes do not pay for: a ResNet's
blocks hold ``nn.Sequential`` shortcuts (a 1x1 convolution and a BatchNorm of 32 parameters), and
its early stages are Sequentials of 20 KB blocks; split down to every such child, resnet50-cpu had
31 units, 22 under 100 KB, and its zero3 step took 597 ms on 2 cores against 526 ms with these
units (10) and 546 ms with only its 4 stages (``benchmarks/zero3_units.py``, 3 rounds). ``Engine(zero3_units=...)`` replaces the default
with module classes or a predicate, taken as given. A parameter belongs to the units it sits under,
minus nested units; so the root unit holds what no block claims (embeddings, heads) for the whole
forward, which keeps functional uses such as a tied output head working.

Lifecycle of one unit in a step:
  forward pre-hook   gather its parameters (waiting on a prefetch if one is in flight), then start
                     gathering the next unit of the previous forward's order (prefetch)
  forward post-hook  free its parameters (the root's own too); hook its outputs so that backward
                     regathers them
  pre-backward       (the outputs' gradient arrived) gather again, prefetch the unit that ran before it
                     (for the root: the last unit, which backward reaches next)
  post-accumulate    each trainable parameter is freed as soon as its gradient is complete
  post-backward      (units with frozen parameters) free them once the unit's inputs got their gradients
[Note: the root after forward] The root frees its own parameters after forward like every unit,
and regathers them when the gradient reaches its outputs, which is after the loss's own backward. A
language model's activation peak is that loss backward (the logits, their log-softmax and its
gradient: three tensors of batch x tokens x vocabulary), so a root kept whole from forward into
backward, or a last unit prefetched at the end of forward, sat on top of the peak: GPT-2 124M's
tied 147 MB embedding and a 27 MB block gather with its send buffer. The price is one gather that
nothing overlaps, the root's, at the start of backward.

[Note: prefetch depth] A unit's gather is started while the unit before it runs, so a rank waits
at a unit only when its peer is more than one unit behind. Small units run for a few milliseconds:
a peer late by one unit's compute (a CPU rank's core taken for a moment, a slower kernel) then
stalls the other rank at every gather. So the unit after next is started too when it holds at most
:data:`SECOND_PREFETCH_MAX_BYTES` of parameters (whole). resnet50-cpu's zero3 step, as a ratio to
``replicate``'s in the same processes (``dspark run --nproc 2 benchmarks/side_by_side.py --workload
resnet50-cpu --pairs zero3:replicate --steps 30``, one unit ahead and two alternated, 3 runs each,
a 2-core AMD EPYC VM): 1.111, 1.116, 1.147 with one, 1.075, 1.081, 1.098 with two; gpt2-cpu (5
units of 100 ms of compute each) unchanged, 1.024 / 1.030 and 1.051 / 1.052. Larger units keep one
unit ahead, as FSDP does: their compute hides more, and a second one gathered would add to the
memory peak (GPT-2 124M's 28 MB blocks stay at one).

A forward that runs *during* backward is a recomputation (activation checkpointing): it gathers what it
needs and frees nothing, the gradients that follow free the parameters. Every gather is an all-gather
per dtype, started in the same order on every rank (same graph, same hooks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dspark import comm
from dspark.engine.compile_boundary import outside_compile
from dspark.engine.param_slot import ParamSlot
from dspark.errors import CollectiveError
from dspark.tensor.batch import batch_leaves, map_batch

__all__ = ["UnitPolicy", "Zero3Scheduler", "unit_modules"]

UnitPolicy = Sequence[type[nn.Module]] | Callable[[str, nn.Module], bool] | None
"""Which modules are zero3 units besides the root: module classes, a ``(name, module) -> bool``
predicate, or None for the default (children of ``nn.ModuleList`` / ``nn.Sequential``)."""
SECOND_PREFETCH_MAX_BYTES = 16 << 20
"""The unit after next is gathered ahead too when its parameters take at most this many bytes whole
(see [Note: prefetch depth])."""
MIN_NESTED_UNIT_BYTES = 1 << 20
"""The default units split a unit further (a container inside a block) only into pieces of at least
this many parameter bytes; smaller ones stay with the unit around them (see [Note: units])."""


_FORWARD, _NO_GRAD, _BACKWARD = 1, 2, 3
_PURPOSES = ("full_state_dict", "save_pretrained")
"""The engine's own calls that gather parameters outside a forward, each its phase in gather tags."""
_PHASE_NAMES = {_FORWARD: "a training forward", _NO_GRAD: "a forward without grad (evaluation)",
                _BACKWARD: "backward", **{4 + i: f"engine.{name}()" for i, name in enumerate(_PURPOSES)}}
_DEFERRED_TAG_CHECKS = 256
"""On an accelerator, gather tags are checked at the end of backward or after this many gathers."""


class _Gather:
    """One all-gather of several same-dtype parameters' shards and an 8-byte tag saying what it
    gathers (see [Note: gather tags]): ``comm.all_gather_parts`` lands every rank's shard of
    parameter ``i`` in its own full, padded storage (``chunk * N`` rows, memory order), which is
    installed as the parameter, and every rank's tag in ``tags``."""

    def __init__(self, slots: list[ParamSlot], label: str, installed: dict[int, ParamSlot],
                 tag: int, check: Callable[[_Gather, torch.Tensor], None]) -> None:
        self.slots = slots
        self.installed = installed
        self.tag = tag
        self._check = check
        header = _tag_tensor(tag, slots[0].dtype, slots[0].param.device)
        n = slots[0].num_ranks
        shards = [_shard(s) for s in slots]
        # each parameter's full, padded storage (chunk * N rows, memory order), and every rank's tag
        self.fulls: list[torch.Tensor] | None = [t.new_empty(n * t.numel()) for t in shards]
        self.tags = header.new_empty((n, header.numel()))
        self.handle: comm.Handle | None = comm.all_gather_parts(
            [*shards, header], [*self.fulls, self.tags], async_op=True, label=label)
        for slot in slots:
            slot.pending = self

    def finish(self) -> None:
        if self.handle is None:
            return
        self.handle.wait()
        self.handle = None
        fulls, self.fulls = self.fulls, None
        try:
            self._check(self, _tags_of(self.tags))
        except BaseException:
            for slot in self.slots:  # nothing was installed: later gathers must not wait on this one
                if slot.pending is self:
                    slot.pending = None
            raise
        assert fulls is not None
        for slot, full in zip(self.slots, fulls, strict=True):
            if slot.pending is self:
                slot.set_full(full)
                self.installed[slot.param.untyped_storage().data_ptr()] = slot


_TAG_BYTES = 8


@functools.lru_cache(maxsize=4096)
def _tag_tensor(tag: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``tag`` as the raw bytes of a few elements of ``dtype`` (a gather copies bytes: any dtype
    carries them exactly); cached, read only."""
    size = torch.empty((), dtype=dtype).element_size()
    header = torch.zeros(-(-_TAG_BYTES // size), dtype=dtype, device=device)
    header.view(torch.uint8)[:_TAG_BYTES].copy_(torch.tensor([tag], dtype=torch.int64).view(torch.uint8))
    return header


def _tags_of(headers: torch.Tensor) -> torch.Tensor:
    """Each rank's tag (int64, one per row) from the gathered headers ``(N, elements)``."""
    raw = headers.contiguous().view(torch.uint8)[:, :_TAG_BYTES]
    return raw.contiguous().view(torch.int64).view(-1).clone()  # never a view of the gather's buffer


def _shard(slot: ParamSlot) -> torch.Tensor:
    if slot.shard_flat is None:
        raise AssertionError(f"{slot.name}: gather without a shard")
    return slot.shard_flat


class _SavedParamView:
    """A tensor autograd saved that is a view of a gathered parameter, kept as the parameter and the
    view's geometry instead of a reference to the storage (see [Note: saved parameters])."""

    __slots__ = ("offset", "shape", "slot", "stride")

    def __init__(self, slot: ParamSlot, shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> None:
        self.slot = slot
        self.shape = shape
        self.stride = stride
        self.offset = offset


class _Unit:
    def __init__(self, index: int, name: str, module: nn.Module, slots: list[ParamSlot]) -> None:
        self.index = index
        self.name = name
        self.label = f"dspark.gather.{name or 'root'}"  # its gathers in traces
        self.module = module
        self.slots = slots
        self.frozen = [s for s in slots if not s.requires_grad]
        self.whole_bytes = sum(s.numel * s.param.element_size() for s in slots)


def _is_unit(policy: UnitPolicy, name: str, module: nn.Module) -> bool:
    if callable(policy) and not isinstance(policy, (list, tuple)):
        return bool(policy(name, module))
    return isinstance(module, tuple(policy or ()))


def _whole_bytes(param: nn.Parameter) -> int:
    return param.numel() * param.element_size()


def unit_modules(root: nn.Module, policy: UnitPolicy = None, *,
                 param_bytes: Callable[[nn.Parameter], int] = _whole_bytes,
                 ) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every unit, the root first (see [Note: units]). ``param_bytes`` gives a
    parameter's whole size, for a model whose parameters are already sharded.

    Example::

        unit_modules(gpt, [Block])   # [("", gpt), ("blocks.0", ...), ("blocks.1", ...)]
    """
    units = [("", root)]
    if policy is None:
        candidates = []
        for name, module in root.named_modules():
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                for child_name, child in module.named_children():
                    if any(True for _ in child.parameters()):
                        candidates.append((f"{name}.{child_name}" if name else child_name, child))
        names = [name for name, _ in candidates]
        for name, module in candidates:
            nested = any(name.startswith(outer + ".") for outer in names)
            if not nested or sum(map(param_bytes, module.parameters())) >= MIN_NESTED_UNIT_BYTES:
                units.append((name, module))
    else:
        for name, module in root.named_modules():
            if name and _is_unit(policy, name, module) and any(True for _ in module.parameters()):
                units.append((name, module))
    seen: set[int] = set()  # a module can sit in two containers: keep the first
    unique = []
    for name, module in units:
        if id(module) not in seen:
            seen.add(id(module))
            unique.append((name, module))
    return unique


def _refuse_freed_call(name: str, slots: list[ParamSlot], unit: _Unit) -> Callable[..., None]:
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
    def __init__(self, root: nn.Module, slots: list[ParamSlot], *, policy: UnitPolicy = None,
                 in_backward: Callable[[], bool], window: Callable[[], int] = lambda: 0) -> None:
        by_param = {id(s.param): s for s in slots}
        # the engine has sharded the parameters by now: their whole sizes come from their slots
        modules = unit_modules(root, policy,
                               param_bytes=lambda p: by_param[id(p)].numel * p.element_size())
        unit_ids = {id(m) for _, m in modules}
        self.units: list[_Unit] = []
        for index, (name, module) in enumerate(modules):
            owned = self._owned_params(module, unit_ids)
            unit_slots = [by_param[id(p)] for p in owned if id(p) in by_param]
            self.units.append(_Unit(index, name, module, unit_slots))
        self._in_backward = in_backward
        self._window = window  # in gather tags: see [Note: ranks in step] in dspark.engine.window
        self._activity: int | None = None  # a call of the engine's own that gathers (full_state_dict)
        self._position = {id(s): i for i, s in enumerate(slots)}  # in gather tags: see [Note: gather tags]
        self._deferred_tags: list[tuple[int, torch.Tensor]] = []
        # on an accelerator, reading a gather's tags would sync the host: check them in batches
        self.defer_tag_checks = any(s.param.device.type != "cpu" for s in slots)
        self._holders: dict[int, int] = {id(s): 0 for s in slots}
        self._slots = slots
        self._order: list[int] = []  # unit indices in the previous forward's order
        self._current_order: list[int] = []
        self._grad_done: set[int] = set()
        self._installed: dict[int, ParamSlot] = {}  # storage pointer -> slot gathered into it
        self._handles: list[Any] = []
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(
                self._pre_forward_hook(unit), with_kwargs=True))
            self._handles.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))
        owner: dict[int, _Unit] = {}
        for unit in self.units:
            for slot in unit.slots:
                owner.setdefault(id(slot), unit)
        for name, module in root.named_modules():
            if id(module) in unit_ids:
                continue  # a unit gathers its own parameters when it is called
            own = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
            if own:
                self._handles.append(module.register_forward_pre_hook(
                    _refuse_freed_call(name, own, owner[id(own[0])])))

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

    def saving_parameters_by_reference(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context a forward runs in so that autograd does not keep freed parameters alive.

        [Note: saved parameters] Autograd saves what backward needs, and for a layer that is often a
        view of a gathered parameter (``nn.Linear`` saves ``weight.t()``). Freeing the parameter
        (swapping its ``.data`` for an empty tensor) does not free such a view's storage, so without
        this every unit stayed whole from its forward to its backward: the whole model at once. Here a
        saved tensor that lives in a gathered parameter's storage is packed as (parameter, view
        geometry) and rebuilt from the regathered parameter when backward unpacks it; everything else
        is saved as usual."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "meta" or tensor.is_sparse:
            return tensor
        ptr = tensor.untyped_storage().data_ptr()
        slot = self._installed.get(ptr)
        if slot is None or not slot.gathered or tensor.dtype != slot.param.dtype:
            return tensor
        base = slot.param.detach()
        if base.untyped_storage().data_ptr() != ptr:  # a stale entry: that storage was freed
            return tensor
        return _SavedParamView(slot, tuple(tensor.shape), tuple(tensor.stride()),
                               int(tensor.storage_offset()) - int(base.storage_offset()))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _SavedParamView):
            return packed  # type: ignore[no-any-return]
        slot = packed.slot
        if not slot.gathered:  # every rank unpacks the same graph: the gather is collective-safe
            self._gather([slot])
        base = slot.param.detach()
        return base.as_strided(packed.shape, packed.stride, base.storage_offset() + packed.offset)

    def largest_unit_bytes(self) -> int:
        return max((sum(s.numel * s.param.element_size() for s in u.slots) for u in self.units), default=0)

    # -- gathering -------------------------------------------------------------------------------
    def _start(self, slots: Iterable[ParamSlot], *, prefetch: bool = False,
               label: str = "dspark.gather") -> None:
        """Launch one all-gather per dtype for the slots that are neither gathered nor in flight (a
        prefetch also skips those whose gradient is complete: backward needs them no more)."""
        by_dtype: dict[torch.dtype, list[ParamSlot]] = {}
        for s in slots:
            if s.gathered or s.pending is not None or (prefetch and id(s) in self._grad_done):
                continue
            by_dtype.setdefault(s.dtype, []).append(s)
        for group in by_dtype.values():
            _Gather(group, label, self._installed, self._tag(group), self._check_tags)

    # [Note: gather tags] Every rank must gather the same parameters in the same order, for the same
    # purpose; a rank that runs a forward of its own (an evaluation on rank 0 only, one more generated
    # token) would otherwise pair its gathers with its peers' next ones: the same sizes exchange the
    # wrong data, or the job hangs at the first collective that differs, until the timeout. So each
    # rank's piece of a gather ends with 8 bytes naming its first and last parameter, the phase
    # (training forward, forward without grad, backward, or the engine call that gathers, e.g.
    # engine.full_state_dict()) and the accumulation window's index modulo 128 (so that a rank that
    # skipped a batch or a step parts from its peers at its next gather), and every rank compares the
    # tags it receives: a mismatch is a CollectiveError on every rank, at the gather where the ranks
    # parted. Bits: window << 56 | phase << 48 | first << 24 | last.
    # On CPU the check reads the tags when the gather lands; on an accelerator it is batched to the
    # end of backward (or every _DEFERRED_TAG_CHECKS gathers), so that no gather adds a host sync.
    def _tag(self, group: list[ParamSlot]) -> int:
        phase = self._activity or (
            _BACKWARD if self._in_backward() else (_FORWARD if torch.is_grad_enabled() else _NO_GRAD))
        return (((self._window() % 128) << 56) | (phase << 48) | (self._position[id(group[0])] << 24)
                | self._position[id(group[-1])])

    def _check_tags(self, gather: _Gather, tags: torch.Tensor) -> None:
        if not self.defer_tag_checks:
            self._verify_tags(gather.tag, tags.tolist())
            return
        self._deferred_tags.append((gather.tag, tags))
        if len(self._deferred_tags) >= _DEFERRED_TAG_CHECKS:
            self._verify_deferred_tags()

    def _verify_deferred_tags(self) -> None:
        deferred, self._deferred_tags = self._deferred_tags, []
        if deferred:
            received = torch.stack([tags for _, tags in deferred]).tolist()  # one host sync
            for (mine, _), tags in zip(deferred, received, strict=True):
                self._verify_tags(mine, tags)

    def _verify_tags(self, mine: int, tags: list[int]) -> None:
        other = next((r for r, tag in enumerate(tags) if tag != mine), None)
        if other is None:
            return
        me = comm.get_world().rank
        windows = (mine >> 56) != (tags[other] >> 56)
        raise CollectiveError(
            f"rank {me}: under zero3 the ranks gathered different parameters in one all-gather: this "
            f"rank gathered {self._describe(mine, windows)}, rank {other} "
            f"{self._describe(tags[other], windows)}. Each "
            "zero3 forward and backward gathers parameters together with every rank, so every rank "
            "must run the same units in the same order. In training, a unit that runs on some ranks "
            "only (an early exit, LayerDrop, expert routing that skips a block on one rank): make "
            "the choice the same on every rank (seed it alike), or run the skipped unit with a zero "
            "contribution (e.g. on an empty batch, or multiplied by 0). In evaluation: evaluate on "
            "every rank (each on its own share of the data), not on rank 0 alone; generate the same "
            "number of tokens on every rank; for an evaluation on one rank, load "
            "engine.full_state_dict() into a plain copy of the model. Or train with "
            "strategy='zero2', which runs such models as one process does.")

    def _describe(self, tag: int, window: bool = False) -> str:
        phase, first, last = (tag >> 48) & 0xFF, (tag >> 24) & 0xFFFFFF, tag & 0xFFFFFF
        if phase not in _PHASE_NAMES or first >= len(self._slots) or last >= len(self._slots):
            return f"something else (tag {tag:#x}: not a zero3 gather of this model)"
        names = self._slots[first].name if first == last else (
            f"{self._slots[first].name} ... {self._slots[last].name}")
        where = f" in accumulation window {tag >> 56} (mod 128)" if window else ""
        return f"{names} for {_PHASE_NAMES[phase]}{where}"

    def _gather(self, slots: Iterable[ParamSlot], label: str = "dspark.gather") -> None:
        slots = list(slots)
        self._start(slots, label=label)
        for slot in slots:
            if slot.pending is not None:
                slot.pending.finish()

    def _prefetch(self, unit_index: int | None, after: int | None = None) -> None:
        """Start gathering unit ``unit_index``, and unit ``after`` (the one that runs next after it)
        too when it is small (see [Note: prefetch depth])."""
        if unit_index is not None:
            unit = self.units[unit_index]
            self._start(unit.slots, prefetch=True, label=unit.label)
        if after is not None and self.units[after].whole_bytes <= SECOND_PREFETCH_MAX_BYTES:
            unit = self.units[after]
            self._start(unit.slots, prefetch=True, label=unit.label)

    def _next_two(self, unit: _Unit, step: int) -> tuple[int | None, int | None]:
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
    def _pre_forward_hook(self, unit: _Unit) -> Any:
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

    def _wrap_inputs(self, unit: _Unit, args: Any, kwargs: Any) -> Any:
        inputs = [t for t in batch_leaves((args, kwargs)) if t.requires_grad]
        if not inputs:
            return None
        wrapped = iter(_AfterUnitBackward.apply(lambda: self._free(unit.frozen), *inputs))
        return map_batch((args, kwargs), lambda t: next(wrapped) if t.requires_grad else t)

    def _post_forward_hook(self, unit: _Unit) -> Any:
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
                        self._gather(unit.slots, unit.label)
                        # backward reaches the root's own parameters (the head) first, then the
                        # last unit; every other unit, then the one that ran before it
                        if unit.index == 0:
                            order = self._order
                            self._prefetch(order[-1] if order else None,
                                           order[-2] if len(order) > 2 else None)
                        else:
                            self._prefetch(*self._next_two(unit, -1))

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
            self._installed.clear()  # every storage it named is freed now
        self._verify_deferred_tags()

    def after_failed_forward(self, exc: RuntimeError) -> RuntimeError | None:
        """A forward failed: free what it left half-gathered, and explain a shape error that an empty
        (freed) parameter read outside its unit causes; None when ``exc`` is not one."""
        freed = [s.name for s in self._slots if s.requires_grad and not s.gathered]
        self.end_backward()  # a failed forward leaves units half-gathered: start clean
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
        """Gather ``slots`` now; ``purpose``: the engine call gathering them (one of ``_PURPOSES``,
        e.g. ``"full_state_dict"``), which the tags and the collective's label then name."""
        if purpose is None:
            self._gather(slots)
            return
        self._activity = 4 + _PURPOSES.index(purpose)
        try:
            self._gather(slots, label=f"dspark.{purpose}.gather")
        finally:
            self._activity = None

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
