"""What a checkpoint saves and loads: anything that hands out a sharded state dict and takes one back.

The checkpoint code knows nothing of the engine's internals (its slots, shards or buckets): it works
through this protocol, which :class:`dspark.Engine` implements (see [Note: sharded state dict] in
:mod:`dspark.engine.state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from dspark.comm import World
from dspark.tensor import Placement

__all__ = ["Checkpointable"]


class Checkpointable(Protocol):
    """An object whose state a DSpark checkpoint holds (``dspark.Engine``)."""

    world: World

    def sharded_state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": {"state", "param_groups"}, "engine": {...}}``, live tensors:
        this rank's rows as Shard(0) DTensors, whole tensors as they are."""
        ...

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install a structure like :meth:`sharded_state_dict`'s."""
        ...

    def empty_shard(self, global_rows: Sequence[int], dtype: torch.dtype) -> Any:
        """An empty tensor for this rank's rows of a sharded tensor of ``global_rows``, laid out as
        ``sharded_state_dict`` lays sharded optimizer state; None when this rank holds no rows."""
        ...

    def placements(self) -> dict[str, dict[str, Placement]]:
        """How parameters, gradients and optimizer state are laid out (``Shard(0)`` or ``Replicate()``)."""
        ...

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (collective)."""
        ...
