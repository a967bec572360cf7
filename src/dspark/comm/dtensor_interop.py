"""Conversion to and from PyTorch's own ``DTensor`` on a 1-D mesh over the whole world (or, for
hybrid sharding, a 2-D mesh of replica and shard groups)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as _TorchReplicate
from torch.distributed.tensor import Shard as _TorchShard

from dspark.comm.collectives import device_mesh

__all__ = ["from_torch_dtensor", "to_torch_dtensor"]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def to_torch_dtensor(local: torch.Tensor, shard_dim: int | None,
                     global_shape: tuple[int, ...], mesh: Any = None) -> DTensor:
    """A DTensor over this rank's ``local`` piece; ``shard_dim=None`` means replicated. ``mesh``:
    the whole world's 1-D mesh by default; a 2-D ``(replica, shard)`` mesh
    (:func:`dspark.comm.mesh_2d`) replicates the piece across its first dim and splits the tensor
    over its second (hybrid sharding)."""
    placement = _TorchReplicate() if shard_dim is None else _TorchShard(shard_dim)
    mesh = device_mesh() if mesh is None else mesh
    placements = [placement] if mesh.ndim == 1 else [_TorchReplicate(), placement]
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape))


def from_torch_dtensor(dtensor: DTensor) -> tuple[torch.Tensor, int | None, tuple[int, ...]]:
    """``(local, shard_dim or None for replicated, global_shape)`` of a 1-D-mesh DTensor."""
    if dtensor.device_mesh.ndim != 1:
        raise ValueError(f"DTensor on a {dtensor.device_mesh.ndim}-D mesh: DSpark converts 1-D meshes "
                         "only (redistribute it to one mesh dimension first)")
    (placement,) = dtensor.placements
    if isinstance(placement, _TorchShard):
        dim: int | None = placement.dim
    elif isinstance(placement, _TorchReplicate):
        dim = None
    else:
        raise ValueError(f"DTensor placement {placement!r} has no DSpark equivalent (Shard or "
                         "Replicate); call dtensor.redistribute(placements=[Replicate()]) first")
    return dtensor.to_local(), dim, tuple(dtensor.shape)
