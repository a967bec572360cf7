"""Groups that partition the world (hybrid sharding's shard groups and replica groups) and the 2-D
``DeviceMesh`` over them that PyTorch's DTensor and distributed checkpoint read.

Every rank creates every group of a partition, in the same order (``torch.distributed.new_group``
is collective over the world), and keeps its own. Groups are made once per partition and world and
reused by later engines; ``dspark.shutdown()`` destroys them with the other side groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dspark.comm.collectives import Group, new_group
from dspark.comm.world_state import World, get_world

__all__ = ["mesh_2d", "partition_groups"]

_Partition = tuple[tuple[int, ...], ...]
_made: dict[tuple[_Partition, str], Group] = {}
_meshes: dict[tuple[_Partition, _Partition], Any] = {}
_made_in: list[World] = []


def _for_this_world() -> None:
    """Forget groups and meshes of a world that was left (shutdown destroyed their groups)."""
    world = get_world()
    if not _made_in or _made_in[0] is not world:
        _made.clear()
        _meshes.clear()
        _made_in[:] = [world]


def partition_groups(blocks: Sequence[Sequence[int]], *, name: str) -> Group:
    """This rank's group of ``blocks``, a partition of the world's ranks into groups (each group's
    byte counters filed under ``name``). Collective the first time for a partition: every rank calls
    it with the same blocks.

    Example::

        shard = partition_groups([(0, 1), (2, 3)], name="shard")     # ranks 0, 1 or 2, 3
        replica = partition_groups([(0, 2), (1, 3)], name="replica")
    """
    world = get_world()
    partition = tuple(tuple(int(r) for r in block) for block in blocks)
    members = sorted(r for block in partition for r in block)
    if members != list(range(world.world_size)):
        raise ValueError(f"partition_groups: {list(partition)!r} does not hold each rank of "
                         f"world_size({world.world_size}) exactly once")
    _for_this_world()
    key = (partition, name)
    if key not in _made:
        mine = None
        for block in partition:  # every rank creates every group, in the same order
            group = new_group(block, name=name)
            if world.rank in block:
                mine = group
        if mine is None:
            raise AssertionError(f"rank {world.rank} is in no block of {partition!r}")
        _made[key] = mine
    return _made[key]


def mesh_2d(outer: Group, inner: Group, ranks: Sequence[Sequence[int]]) -> Any:
    """PyTorch's 2-D ``DeviceMesh`` over existing groups: ``ranks[i][j]`` is the global rank at
    ``outer`` rank ``i``, ``inner`` rank ``j`` (dims named ``"replica"`` and ``"shard"``), made once.

    Example::

        mesh = mesh_2d(replica, shard, [(0, 1), (2, 3)])   # DTensor placements [Replicate(), Shard(0)]
    """
    _for_this_world()
    table = tuple(tuple(int(r) for r in row) for row in ranks)
    key = (table, tuple(zip(*table, strict=True)))
    if key not in _meshes:
        from torch.distributed.device_mesh import DeviceMesh

        world = get_world()
        _meshes[key] = DeviceMesh.from_group([outer.pg, inner.pg], world.device.type,
                                             mesh=torch.tensor(table, dtype=torch.int64),
                                             mesh_dim_names=("replica", "shard"))
    return _meshes[key]
