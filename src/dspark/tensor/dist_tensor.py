"""``DistTensor``: a tensor split (or replicated, explicitly) across the ranks of the world."""

from __future__ import annotations

from typing import Any

import torch

from dspark import comm
from dspark.tensor.placement import Placement, PlacementError, Replicate, Shard, to_placement
from dspark.tensor.shard_math import chunk_size, shard_range, shard_shape

__all__ = ["DistTensor", "distribute_tensor"]


class DistTensor:
    """This rank's piece of a distributed tensor, with the placement that says how it is split.

    Build one with :func:`distribute_tensor` or :meth:`from_dtensor`; ``local`` must be exactly the
    shard this rank owns under the uneven split rule (see :mod:`dspark.tensor.shard_math`).
    """

    __slots__ = ("_global_shape", "_local", "_placement")

    def __init__(self, local: torch.Tensor, placement: Placement,
                 global_shape: tuple[int, ...] | torch.Size) -> None:
        if not isinstance(placement, (Shard, Replicate)):
            raise PlacementError(f"placement={placement!r} is not dspark.Shard(dim) or dspark.Replicate()")
        shape = tuple(int(s) for s in global_shape)
        world = comm.get_world()
        if isinstance(placement, Shard):
            if not 0 <= placement.dim < len(shape):
                raise PlacementError(f"{placement!r} is out of range for global shape {shape}")
            want = shard_shape(shape, placement.dim, world.world_size, world.rank)
        else:
            want = shape
        if tuple(local.shape) != want:
            raise PlacementError(
                f"rank {world.rank}: local piece of shape {tuple(local.shape)} does not match "
                f"{placement!r} of global shape {shape} on {world.world_size} ranks (expected {want})")
        self._local = local
        self._placement: Placement = placement
        self._global_shape = torch.Size(shape)

    # -- what it is ----------------------------------------------------------------------------
    @property
    def local(self) -> torch.Tensor:
        """This rank's shard (the whole tensor when replicated)."""
        return self._local

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def global_shape(self) -> torch.Size:
        return self._global_shape

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def local_bytes(self) -> int:
        """Bytes this rank holds for the tensor."""
        return self._local.numel() * self._local.element_size()

    def __repr__(self) -> str:
        world = comm.get_world()
        return (f"DistTensor(global_shape={tuple(self._global_shape)}, placement={self._placement!r}, "
                f"local_shape={tuple(self._local.shape)}, dtype={self.dtype}, "
                f"rank={world.rank}/{world.world_size})")

    # -- moving data ---------------------------------------------------------------------------
    def full(self) -> torch.Tensor:
        """The whole tensor on every rank (gathered when sharded; a copy when replicated)."""
        if isinstance(self._placement, Replicate):
            return self._local.clone()
        dim = self._placement.dim
        world = comm.get_world()
        size = self._global_shape[dim]
        rows = chunk_size(size, world.world_size)
        piece = self._local.movedim(dim, 0)
        padded = piece.new_zeros((rows, *piece.shape[1:]))
        padded[: piece.shape[0]] = piece
        gathered = padded.new_empty((rows * world.world_size, *piece.shape[1:]))
        comm.all_gather_into_tensor(gathered, padded)
        return gathered[:size].movedim(0, dim).contiguous()

    def redistribute(self, shard_dim: Any) -> DistTensor:
        """The same tensor under another placement (``shard_dim`` as in :func:`distribute_tensor`).

        Shard -> Replicate gathers; Replicate -> Shard slices locally (no communication);
        Shard(a) -> Shard(b) gathers then slices.
        """
        target = to_placement(shard_dim, self._global_shape, what="DistTensor")
        if target == self._placement:
            return self
        whole = self._local if isinstance(self._placement, Replicate) else self.full()
        return _from_whole(whole, target)

    def to_dtensor(self) -> Any:
        """PyTorch's ``DTensor`` with the same placement, sharing this rank's storage."""
        from dspark.comm.dtensor_interop import to_torch_dtensor

        dim = self._placement.dim if isinstance(self._placement, Shard) else None
        return to_torch_dtensor(self._local, dim, tuple(self._global_shape))

    @classmethod
    def from_dtensor(cls, dtensor: Any) -> DistTensor:
        """Wrap a PyTorch ``DTensor`` (1-D mesh, Shard or Replicate) without copying."""
        from dspark.comm.dtensor_interop import from_torch_dtensor

        local, dim, shape = from_torch_dtensor(dtensor)
        return cls(local, Replicate() if dim is None else Shard(dim), shape)


def _from_whole(whole: torch.Tensor, placement: Placement) -> DistTensor:
    if isinstance(placement, Replicate):
        return DistTensor(whole, placement, tuple(whole.shape))
    world = comm.get_world()
    start, stop = shard_range(whole.shape[placement.dim], world.world_size, world.rank)
    local = whole.narrow(placement.dim, start, stop - start).contiguous().clone()
    return DistTensor(local, placement, tuple(whole.shape))


def distribute_tensor(tensor: torch.Tensor, shard_dim: Any) -> DistTensor:
    """Split ``tensor`` across ranks along ``shard_dim``, or replicate it when
    ``shard_dim=dspark.REPLICATE``. ``None`` and other non-placements raise
    :class:`dspark.PlacementError`.

    Every rank passes the same whole tensor. Sharding keeps this rank's rows (a copy, so the whole
    tensor can be freed; no communication); replication broadcasts rank 0's tensor so that all
    ranks agree.

    Example::

        x = dspark.distribute_tensor(torch.arange(14.).view(7, 2), shard_dim=0)
        x.local.shape   # (4, 2) on rank 0 and (3, 2) on rank 1 of 2
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor expects a torch.Tensor, got {type(tensor).__name__}")
    placement = to_placement(shard_dim, tuple(tensor.shape))
    if isinstance(placement, Replicate):
        whole = tensor.detach().clone()
        comm.broadcast(whole, src=0)
        return DistTensor(whole, placement, tuple(tensor.shape))
    return _from_whole(tensor.detach(), placement)
