"""The groups an engine's collectives run over: the shard group that splits what the strategy shards,
and (hybrid sharding) the replica group across shard groups; see [Note: hybrid sharding] in
:mod:`dspark.policy.rank_groups`. A flat strategy has one shard group, the world, and no replica
group, so every part of the engine reads its ranks from here whatever the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dspark import comm
from dspark.comm import World
from dspark.policy.rank_groups import GroupLayout, group_layout
from dspark.policy.strategies import ShardingPolicy

__all__ = ["RankGroups", "form_rank_groups"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankGroups:
    """This rank's shard group and replica group (None: one shard group, the whole world)."""

    layout: GroupLayout
    shard: comm.Group
    """The ranks that split the sharded parts between them; their collectives are the stage's own."""
    replica: comm.Group | None
    """The ranks holding the same rows in the other shard groups: each gradient shard is all-reduced
    over them. None when the shard group is the whole world."""

    @property
    def shard_rank(self) -> int:
        return self.shard.rank

    @property
    def shard_size(self) -> int:
        return self.shard.size

    def mesh(self) -> Any:
        """The 2-D ``(replica, shard)`` DeviceMesh a sharded DTensor lives on under hybrid sharding;
        None when the shard group is the world (the 1-D world mesh)."""
        if self.replica is None:
            return None
        return comm.mesh_2d(self.replica, self.shard, self.layout.shard_groups())


def form_rank_groups(world: World, policy: ShardingPolicy, *, shard_group_size: int | None) -> RankGroups:
    """The groups ``policy`` runs over on this rank: the world for a flat strategy; for a hybrid one,
    shard groups of ``shard_group_size`` ranks, or of one node's ranks. Collective (every rank calls
    it at construction); raises on every rank when the layout does not fit the world.

    Example::

        groups = form_rank_groups(world, HYBRID_STRATEGIES["hybrid-zero3"], shard_group_size=2)
        groups.shard.size, groups.replica.size   # (2, 2) on 4 ranks
    """
    if not policy.hybrid:
        if shard_group_size is not None:
            raise ValueError(f"shard_group_size={shard_group_size!r} sizes a hybrid strategy's shard groups; "
                             f"strategy={policy.name!r} shards over the whole world: pass "
                             f"strategy='hybrid-{policy.stage}' with it, or leave it out")
        layout = GroupLayout(world_size=world.world_size, shard_group_size=world.world_size)
        return RankGroups(layout=layout, shard=comm.default_group(), replica=None)
    if shard_group_size is None and world.world_size > 1:
        _check_node_layout(world)
    layout = group_layout(world.world_size, shard_group_size=shard_group_size,
                          local_world_size=world.local_world_size)
    if layout.is_flat:
        return RankGroups(layout=layout, shard=comm.default_group(), replica=None)
    shard = comm.partition_groups(layout.shard_groups(), name="shard")
    replica = comm.partition_groups(layout.replica_groups(), name="replica")
    return RankGroups(layout=layout, shard=shard, replica=replica)


def _check_node_layout(world: World) -> None:
    """Every rank's node has as many ranks (``LOCAL_WORLD_SIZE``) and holds consecutive ranks, so that a
    node's ranks form one shard group; else the same ``ValueError`` on every rank."""
    nodes = comm.all_gather_object((world.local_rank, world.local_world_size), label="dspark.node_layout")
    sizes = sorted({size for _, size in nodes})
    if len(sizes) > 1:
        raise ValueError(f"rank {world.rank}: a hybrid strategy shards inside a node, and the nodes hold "
                         f"different numbers of ranks (LOCAL_WORLD_SIZE {sizes}); start the same number of "
                         "ranks on every node, or pass shard_group_size=")
    size = sizes[0]
    apart = [r for r, (local, _) in enumerate(nodes) if r % size != local]
    if apart:
        raise ValueError(f"rank {world.rank}: a hybrid strategy shards inside a node, but rank {apart[0]} is "
                         f"local rank {nodes[apart[0]][0]} of its node, not {apart[0] % size}: the nodes' ranks "
                         "are not consecutive. Pass shard_group_size= to group ranks by number instead")
