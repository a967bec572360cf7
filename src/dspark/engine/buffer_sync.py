"""Buffers equal on every rank: rank 0's buffers are broadcast before each training forward, as DDP's
default ``broadcast_buffers=True`` does, so BatchNorm running statistics never drift apart.

[Note: which buffers travel] Broadcasting every buffer on every forward wastes bandwidth on constants
(attention masks, position ids). The first training forward records each buffer's version counter and
a copy of its values; the second sees which ones changed (running statistics do, constants do not),
the ranks agree once on the union, and from then on only those travel, coalesced into one broadcast
per dtype. Both are needed: BatchNorm's CPU kernel writes its running statistics in place without
bumping their version counter (only ``num_batches_tracked``'s moves), and a buffer assigned anew
keeps values that may not have changed. The copy is taken once, on the first forward. A constant
buffer that changes later on one rank only is not followed (the construction broadcast made them
equal).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark import comm

__all__ = ["BufferSync", "broadcast_tensors"]


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, *, label: str = "dspark.buffers.broadcast") -> None:
    """Overwrite ``tensors`` with rank ``src``'s values: one broadcast per dtype (collective), named
    ``label``."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same]) if len(same) > 1 else same[0].reshape(-1).clone()
        comm.broadcast(flat, src=src, label=label)
        # one C++ call each way: a ResNet-50 has 159 buffers, copied one by one in Python they cost
        # more than the broadcast itself
        torch._foreach_copy_(same, [v.view_as(t) for v, t in zip(torch.split(flat, [t.numel() for t in same]),
                                                                    same, strict=True)])


class BufferSync:
    """Keep ``module``'s buffers (but those in ``skip``) equal to rank 0's before each training forward."""

    def __init__(self, module: nn.Module, *, skip: set[int] | None = None) -> None:
        self.module = module
        self.skip = skip or set()
        self._versions: dict[str, int] | None = None
        self._values: dict[str, torch.Tensor] = {}
        self._dynamic: list[str] | None = None

    def _named(self) -> dict[str, torch.Tensor]:
        return {name: b for name, b in self.module.named_buffers() if id(b) not in self.skip}

    def before_forward(self) -> None:
        """Call on every rank before a forward that will be backpropagated, in training mode."""
        buffers = self._named()
        if not buffers:
            return
        if self._versions is None:
            self._versions = {name: b._version for name, b in buffers.items()}
            self._values = {name: b.detach().clone() for name, b in buffers.items()}
            return
        if self._dynamic is None:
            versions = self._versions
            changed = [name for name, b in buffers.items()
                       if b._version != versions.get(name) or self._values_changed(name, b)]
            self._values = {}
            union = set().union(*comm.all_gather_object(changed, label="dspark.buffers.changed"))
            self._dynamic = [name for name in buffers if name in union]
        broadcast_tensors([buffers[name] for name in self._dynamic if name in buffers])

    def _values_changed(self, name: str, buffer: torch.Tensor) -> bool:
        before = self._values.get(name)
        if before is None:
            return True
        return before.shape != buffer.shape or before.dtype != buffer.dtype or not torch.equal(before, buffer)
