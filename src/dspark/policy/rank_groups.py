"""How hybrid sharding splits the world into shard groups and replica groups: pure arithmetic on rank
numbers, no process group (the engine forms the groups in :mod:`dspark.engine.rank_groups`, the
planner prices them in :mod:`dspark.planner.cost`).

[Note: hybrid sharding] A hybrid strategy (``hybrid-zero1/2/3``) runs its ZeRO stage inside a *shard
group* of ``S`` consecutive ranks, by default one node's (``LOCAL_WORLD_SIZE``, which ``dspark run``,
``torchrun`` and Slurm set; a node's ranks are consecutive), and keeps one replica of the shards in
each of the ``R = world_size / S`` groups. Rank ``r`` is rank ``r % S`` of shard group ``r // S`` and
rank ``r // S`` of *replica group* ``r % S`` (the ranks holding the same rows: ``r % S``,
``r % S + S``, ...). Sharded parts (optimizer state, gradients, parameters, as the stage says) are
split over ``S`` ranks, so a rank holds the shard group's share, ``1/S``, not ``1/world_size``. What
each level carries per step: inside a group, the stage's own collectives (zero3's gathers, the
reduce-scatter of gradients, zero1/zero2's gather of updated rows) on the fast link; across groups,
one all-reduce of each rank's gradient shard (``1/S`` of the gradients) over the slow link, instead
of every gather. zero1 keeps whole gradients, so its gradients are all-reduced over the whole world
as under zero1. Each rank averages over all ``world_size`` ranks: the update is plain data parallel's.

Example::

    layout = group_layout(world_size=4, shard_group_size=2)
    layout.shard_groups()     # [(0, 1), (2, 3)]
    layout.replica_groups()   # [(0, 2), (1, 3)]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GroupLayout", "group_layout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLayout:
    """``world_size`` ranks in shard groups of ``shard_group_size`` consecutive ranks (see [Note:
    hybrid sharding]). One group of the whole world is a flat strategy's layout."""

    world_size: int
    shard_group_size: int

    def __post_init__(self) -> None:
        w, s = self.world_size, self.shard_group_size
        for name, value in (("world_size", w), ("shard_group_size", s)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if w % s:
            raise ValueError(f"shard_group_size={s} does not divide the world: world_size({w}) % "
                             f"shard_group_size({s}) != 0 ({w} % {s} = {w % s}); pick a divisor of "
                             f"{w}: {', '.join(str(d) for d in range(1, w + 1) if w % d == 0)}")

    @property
    def num_replicas(self) -> int:
        """Shard groups in the world: the size of each replica group."""
        return self.world_size // self.shard_group_size

    @property
    def is_flat(self) -> bool:
        """One shard group over the whole world: nothing is replicated across groups."""
        return self.shard_group_size == self.world_size

    def shard_rank(self, rank: int) -> int:
        """``rank``'s place in its shard group (which rows it holds)."""
        return rank % self.shard_group_size

    def replica_rank(self, rank: int) -> int:
        """``rank``'s place in its replica group (which shard group it is in)."""
        return rank // self.shard_group_size

    def shard_groups(self) -> list[tuple[int, ...]]:
        """Every shard group's ranks, group 0 first."""
        s = self.shard_group_size
        return [tuple(range(g * s, (g + 1) * s)) for g in range(self.num_replicas)]

    def replica_groups(self) -> list[tuple[int, ...]]:
        """Every replica group's ranks (those holding the same rows), group 0 first."""
        return [tuple(range(i, self.world_size, self.shard_group_size)) for i in range(self.shard_group_size)]


def group_layout(world_size: int, *, shard_group_size: int | None = None,
                 local_world_size: int | None = None) -> GroupLayout:
    """The layout of hybrid sharding on ``world_size`` ranks: shard groups of ``shard_group_size``
    ranks when given, else one node's ranks (``local_world_size``, from ``LOCAL_WORLD_SIZE``).

    Example::

        group_layout(16, local_world_size=8).replica_groups()[0]   # (0, 8): rank 0 of each node
        group_layout(6, shard_group_size=4)   # ValueError: world_size(6) % shard_group_size(4) != 0
    """
    if shard_group_size is not None:
        return GroupLayout(world_size=world_size, shard_group_size=shard_group_size)
    if local_world_size is None:
        raise ValueError("a hybrid strategy needs its shard group's size: pass shard_group_size=, or run "
                         "under dspark run / torchrun / Slurm, which set LOCAL_WORLD_SIZE (the ranks of a node)")
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1 \
            or world_size % local_world_size:
        raise ValueError(f"a hybrid strategy shards inside a node, and the nodes are not equal: world_size"
                         f"({world_size}) % LOCAL_WORLD_SIZE({local_world_size!r}) != 0; start the same number "
                         "of ranks on every node, or pass shard_group_size=")
    return GroupLayout(world_size=world_size, shard_group_size=local_world_size)
