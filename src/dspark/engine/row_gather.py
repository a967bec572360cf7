"""zero1/zero2's gather of the updated rows straight into the parameters.

[Note: rows gathered in place] After the optimizer step each rank of zero1/zero2 holds its own rows
updated and needs every other rank's. Packed, a bucket copies its rows into a send buffer, the
collective lands every rank's rows in a receive buffer, and each rank copies the others' rows out
into its parameters: two copies of the bucket's bytes beside the collective's own, and a receive
buffer the size of the bucket, allocated afresh each step (past the C library's mmap threshold,
faulted in page by page). Where the collective runs through shared memory
(:func:`dspark.comm.all_gather_parts` reads each rank's part where it is and writes each output in
place) and every parameter of the bucket splits into equal rows over the ranks (no padding) in a
dense storage, this rank's rows are already the part and the parameter's storage already the
output, in memory order: one collective, no buffer, no copy of the engine's. A bucket with a padded
or strided parameter, or a process group that packs the parts anyway (gloo, NCCL, a hybrid shard
group), keeps the packed path, whose two pooled buffers bound the memory in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark import comm
from dspark.engine.param_slot import ParamSlot

__all__ = ["in_place_parts", "land_packed_rows", "lands_in_place"]


def lands_in_place(group: comm.Group | None, device: torch.device) -> bool:
    """Whether ``group``'s all-gathers of ``device`` tensors write each output in place: the
    default group's shared-memory transport (see [Note: rows gathered in place])."""
    return device.type == "cpu" and (group is None or group.pg is None) and comm.transport() == "shm"


def _dense_flat(slot: ParamSlot) -> torch.Tensor | None:
    """The parameter's storage as one 1-D view in memory order, or None where its elements do not
    fill one span of it (an overlapping or strided view)."""
    param = slot.param.detach()
    expected = 1
    for size, stride in sorted(zip(param.shape, param.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return None
        expected *= size
    return param.as_strided((slot.numel,), (1,))


def in_place_parts(slots: Sequence[ParamSlot], rank: int, num_ranks: int
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """``(this rank's rows, the whole parameter)`` of every slot, flat in memory order, where each
    splits into equal rows over ``num_ranks`` ranks in a dense storage: an all-gather of the parts
    into the wholes lands every rank's rows in place; None where any does not (see [Note: rows
    gathered in place]).

    Example::

        parts, wholes = in_place_parts(bucket.slots, rank, 2)   # a bucket of 256 x 256 layers
    """
    parts, wholes = [], []
    for slot in slots:
        whole = _dense_flat(slot)
        if whole is None or slot.rows % num_ranks or slot.numel == 0:
            return None
        rows = slot.rows // num_ranks * slot.row_numel
        parts.append(whole[rank * rows:(rank + 1) * rows])
        wholes.append(whole)
    return parts, wholes


def land_packed_rows(slots: Sequence[ParamSlot], offsets: Sequence[int], rank: int, out: torch.Tensor) -> None:
    """The packed path: copy the other ranks' rows of each slot from the gathered ``(N, seg)``
    buffer ``out`` (slot ``i``'s padded rows at ``offsets[i]`` of each rank's row, see [Note: send
    layout] in :mod:`dspark.engine.grad_bucket`) into its parameter."""
    for slot, offset in zip(slots, offsets, strict=True):
        full = slot.rows_view(slot.param.detach())
        for r in range(out.shape[0]):
            start, stop = min(r * slot.chunk, slot.rows), min((r + 1) * slot.chunk, slot.rows)
            if r != rank and stop > start:
                full[start:stop].copy_(slot.view_rows(out[r, offset:], stop - start))
