"""How one tensor of the engine is handed to DCP: a ``Shard(0)`` DTensor with its global shape when
ranks hold different rows of it, the plain tensor when it is whole on this rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dspark import comm
from dspark.tensor import DistTensor, Shard

__all__ = ["for_dcp"]


def for_dcp(local: torch.Tensor, global_shape: Sequence[int], *, sharded: bool) -> Any:
    """``local`` as DCP should see it. ``sharded``: ``local`` is this rank's rows of a tensor of
    ``global_shape`` (uneven split rule), so DCP gets a DTensor sharing its storage and can save or
    load just those rows; otherwise ``local`` is the whole tensor, the same on every rank.

    Example::

        for_dcp(slot.opt_param.detach(), (7, 2), sharded=True)   # DTensor S(0) on 2 ranks
    """
    if not sharded or comm.get_world().world_size == 1:
        return local  # one rank holds every row: the whole tensor, no DTensor (and no group) needed
    return DistTensor(local, Shard(0), tuple(global_shape)).to_dtensor()
