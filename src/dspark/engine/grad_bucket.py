"""Gradient buckets: parameters grouped (in reverse registration order, about ``bucket_mb`` each) so
that one collective reduces many gradients, launched from autograd hooks as soon as every gradient of
the bucket is ready — reduction overlaps the rest of backward.

[Note: bucket order] Buckets launch strictly in index order on every rank: a ready bucket waits for the
earlier ones. Ranks therefore issue the same collectives in the same order even when a parameter gets
no gradient on some rank; such buckets launch when backward ends, the missing gradients counting as
zeros.

[Note: used flags] Each bucket carries one extra element per parameter: 1 when this rank produced a
gradient for it. After the reduction a parameter whose flag sums to 0 got no gradient on any rank, and
keeps ``grad=None`` as in single-process PyTorch (the optimizer skips it).
"""

from __future__ import annotations

import torch

from dspark import comm
from dspark.engine.param_slot import ParamSlot

__all__ = ["GradBucket", "make_buckets"]


class GradBucket:
    def __init__(self, index: int, slots: list[ParamSlot], *, num_ranks: int, shard_grads: bool,
                 reduce_dtype: torch.dtype | None) -> None:
        self.index = index
        self.slots = slots
        self.num_ranks = num_ranks
        self.shard_grads = shard_grads
        self.reduce_dtype = reduce_dtype
        self.ready: set[int] = set()
        self.launched = False
        self._handle: comm.Handle | None = None
        self._buffer: torch.Tensor | None = None  # what the collective writes

    def mark_ready(self, slot_index: int) -> bool:
        """Record that slot ``slot_index`` of this bucket has its gradient; True when all have."""
        self.ready.add(slot_index)
        return len(self.ready) == len(self.slots)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def _wire_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.slots[0].dtype

    def launch(self, pre_scale: float) -> None:
        """Copy the gradients into one buffer and start the reduction (async). ``pre_scale`` multiplies
        the gradients on the way in (1/N for low-precision wires, so the sum cannot overflow)."""
        if self.launched:
            raise AssertionError(f"bucket {self.index} launched twice")
        self.launched = True
        n = len(self.slots)
        dtype = self._wire_dtype()
        device = self.slots[0].param.device
        flags = torch.tensor([float(s.param.grad is not None) for s in self.slots], dtype=dtype,
                             device=device)
        if not self.shard_grads:
            buf = torch.empty(self.numel + n, dtype=dtype, device=device)
            offset = 0
            for slot in self.slots:
                dst = buf[offset: offset + slot.numel]
                grad = slot.param.grad
                if grad is None:
                    dst.zero_()
                else:
                    dst.copy_(grad.reshape(-1))
                offset += slot.numel
            if pre_scale != 1.0:
                buf[:offset].mul_(pre_scale)
            buf[offset:] = flags
            self._buffer = buf
            self._handle = comm.all_reduce(buf, async_op=True)
            return
        # reduce-scatter: rank r's segment holds chunk r of every parameter, then the flags.
        seg = sum(s.shard_numel for s in self.slots) + n
        send = torch.zeros((self.num_ranks, seg), dtype=dtype, device=device)
        offset = 0
        for slot in self.slots:
            grad = slot.param.grad
            if grad is not None:
                flat = grad.reshape(-1)
                padded_numel = slot.shard_numel * self.num_ranks
                if flat.numel() != padded_numel:
                    flat = torch.cat([flat, flat.new_zeros(padded_numel - flat.numel())])
                send[:, offset: offset + slot.shard_numel].copy_(flat.view(self.num_ranks, -1))
                slot.param.grad = None  # the full gradient is not kept under zero2/zero3
            offset += slot.shard_numel
        if pre_scale != 1.0:
            send[:, :offset].mul_(pre_scale)
        send[:, offset:] = flags
        out = torch.empty(seg, dtype=dtype, device=device)
        self._buffer = out
        self._handle = comm.reduce_scatter_tensor(out, send, async_op=True)

    def finish(self, post_scale: float) -> None:
        """Wait for the reduction and put the averaged gradients where the optimizer reads them."""
        if self._handle is None or self._buffer is None:
            raise AssertionError(f"bucket {self.index} finished before it was launched")
        self._handle.wait()
        buf = self._buffer
        n = len(self.slots)
        used_anywhere = (buf[-n:] > 0).tolist()
        offset = 0
        for slot, used in zip(self.slots, used_anywhere, strict=True):
            size = slot.shard_numel if self.shard_grads else slot.numel
            piece = buf[offset: offset + size]
            offset += size
            if self.shard_grads:
                if not used:
                    slot.shard_grad = None
                    continue
                grad = torch.empty(slot.shard_numel, dtype=slot.dtype, device=piece.device)
                grad.copy_(piece).mul_(post_scale)
                slot.shard_grad = grad
            else:
                if not used:
                    slot.param.grad = None
                    continue
                if slot.param.grad is None:
                    slot.param.grad = torch.zeros_like(slot.param)
                slot.param.grad.view(-1).copy_(piece).mul_(post_scale)
        self._handle = None
        self._buffer = None
        self.ready.clear()
        self.launched = False


def make_buckets(slots: list[ParamSlot], *, bucket_mb: float, num_ranks: int, shard_grads: bool,
                 reduce_dtype: torch.dtype | None) -> list[GradBucket]:
    """Group ``slots`` in reverse order (the order backward produces gradients) into buckets of about
    ``bucket_mb`` megabytes (at least one parameter each; MB = 2**20 bytes)."""
    limit = bucket_mb * 2**20
    groups: list[list[ParamSlot]] = []
    current: list[ParamSlot] = []
    size = 0.0
    for slot in reversed(slots):
        nbytes = slot.numel * slot.param.element_size()
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0.0
        current.append(slot)
        size += nbytes
    if current:
        groups.append(current)
    return [GradBucket(i, g, num_ranks=num_ranks, shard_grads=shard_grads, reduce_dtype=reduce_dtype)
            for i, g in enumerate(groups)]
