"""What autograd saves of a zero3 parameter, kept by reference so that freeing the parameter frees
its memory ([Note: saved parameters]); :mod:`dspark.engine.zero3_units` runs each forward under
:meth:`SavedParams.hooks`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dspark.engine.param_slot import ParamSlot

__all__ = ["SavedParamView", "SavedParams"]


class SavedParamView:
    """A tensor autograd saved that is a view of a gathered parameter, kept as the parameter and the
    view's geometry instead of a reference to the storage (see [Note: saved parameters])."""

    __slots__ = ("offset", "shape", "slot", "stride")

    def __init__(self, slot: ParamSlot, shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> None:
        self.slot = slot
        self.shape = shape
        self.stride = stride
        self.offset = offset


class SavedParams:
    """Packs saved views of gathered parameters by reference and rebuilds them in backward.

    [Note: saved parameters] Autograd saves what backward needs, and for a layer that is often a
    view of a gathered parameter (``nn.Linear`` saves ``weight.t()``). Freeing the parameter
    (swapping its ``.data`` for an empty tensor) does not free such a view's storage, so without
    this every unit stayed whole from its forward to its backward: the whole model at once. Here a
    saved tensor that lives in a gathered parameter's storage is packed as (parameter, view
    geometry) and rebuilt from the regathered parameter when backward unpacks it; everything else
    is saved as usual.

    ``gather(slots)`` gathers freed parameters again (collective: every rank unpacks the same graph);
    ``installed`` maps the storage of each gathered parameter to its slot (the gathers fill it, the
    owner clears it once those storages are freed).
    """

    def __init__(self, gather: Callable[[list[ParamSlot]], None]) -> None:
        self._gather = gather
        self.installed: dict[int, ParamSlot] = {}  # storage pointer -> slot gathered into it
        self.packed: set[int] = set()
        """``id`` of each slot a saved tensor was packed from since the owner last cleared it: the
        parameters backward reads (see [Note: frozen parameters in backward])."""

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context a forward runs in so that autograd does not keep freed parameters alive."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "meta" or tensor.is_sparse:
            return tensor
        ptr = tensor.untyped_storage().data_ptr()
        slot = self.installed.get(ptr)
        if slot is None or not slot.gathered or tensor.dtype != slot.param.dtype:
            return tensor
        base = slot.param.detach()
        if base.untyped_storage().data_ptr() != ptr:  # a stale entry: that storage was freed
            return tensor
        self.packed.add(id(slot))
        return SavedParamView(slot, tuple(tensor.shape), tuple(tensor.stride()),
                              int(tensor.storage_offset()) - int(base.storage_offset()))

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, SavedParamView):
            return packed  # type: ignore[no-any-return]
        slot = packed.slot
        if not slot.gathered:  # every rank unpacks the same graph: the gather is collective-safe
            self._gather([slot])
        base = slot.param.detach()
        return base.as_strided(packed.shape, packed.stride, base.storage_offset() + packed.offset)
