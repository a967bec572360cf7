"""The hybrid rows of a plan: the shard group size each is planned with, and the refusal of a
``shard_group_size`` that makes no hybrid row, or none on a device count it does not divide, or is
given without a hybrid strategy (a plan for ``devices=[8], shard_group_size=3`` left its hybrid rows
out without a word; one for ``strategies=["zero3"], shard_group_size=4`` ignored it).

Example::

    hybrid_group(get_interconnect("nvlink"), 64, None)   # 8: eight nodes of 8
    check_shard_group_size([1, 2, 8], 3, ["zero3", "hybrid-zero3"], every=True)   # ValueError: 3 does not divide 8
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark.planner.interconnect import Interconnect
from dspark.policy.rank_groups import GroupLayout
from dspark.policy.strategies import HYBRID_STRATEGIES

__all__ = ["check_shard_group_size", "hybrid_group"]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_shard_group_size(counts: Sequence[int], shard_group_size: int, strategies: Sequence[str], *,
                           every: bool) -> None:
    """Refuse a ``shard_group_size`` that would be ignored or leave hybrid rows out without a word:
    given for ``strategies`` without a hybrid one; beside ``every`` strategy, one that does not divide
    a device count larger than it, or makes several groups of several ranks on none of ``counts``
    (a hybrid strategy named is refused by :func:`hybrid_group` on any count it does not divide, as
    the engine refuses it). The message names the values and what to pick instead.

    Example::

        check_shard_group_size([1, 2, 8], 4, ["zero3", "hybrid-zero3"], every=True)   # fine: hybrid rows on 8
    """
    size = shard_group_size
    if not set(strategies) & set(HYBRID_STRATEGIES):
        raise ValueError(f"shard_group_size={size} is for hybrid strategies, and strategies={list(strategies)!r} "
                         "has none: add one (e.g. hybrid-zero3) or leave shard_group_size out")
    for n in counts:
        if every and n > size and n % size:
            raise ValueError(f"shard_group_size={size} does not divide devices={n} ({n} % {size} = {n % size}): "
                             f"hybrid rows need shard groups that split the ranks evenly; pick a divisor "
                             f"of {n} ({_divisors(n)}) or device counts that {size} divides")
    if every and not any(1 < size < n for n in counts):
        largest = max(counts)
        fits = [d for d in range(2, largest) if largest % d == 0]
        pick = (f"pick one of {', '.join(map(str, fits))} for {largest} devices" if fits
                else f"add a device count of several groups of {size} (e.g. {2 * max(size, 2)})")
        raise ValueError(f"shard_group_size={size} makes no hybrid row on devices={list(counts)}: a hybrid row "
                         f"needs several shard groups of several ranks (1 < shard_group_size < devices); {pick}")


def hybrid_group(link: Interconnect, num_ranks: int, shard_group_size: int | None, *,
                 required: bool = True) -> int | None:
    """The shard group size a hybrid row on ``num_ranks`` ranks is planned with: ``shard_group_size``,
    else one node of ``link`` (its ``ranks_per_node``; ``nvlink``: 8). With ``required`` (a hybrid
    strategy asked for by name) a size that does not fit is a ``ValueError``; without (``"all"``),
    None where the ranks would not make several groups of several ranks.

    Example::

        hybrid_group(get_interconnect("nvlink"), 64, None)   # 8: eight nodes of 8
        hybrid_group(get_interconnect("nvlink"), 8, None, required=False)   # None: one node
    """
    if shard_group_size is not None:
        if required:
            GroupLayout(world_size=num_ranks, shard_group_size=shard_group_size)  # the refusal, with divisors
        size = shard_group_size
    elif link.ranks_per_node is not None:
        size = min(link.ranks_per_node, num_ranks)  # fewer ranks than a node: one group
    elif required:
        raise ValueError(f"interconnect {link.name!r} has no node size: pass shard_group_size= for a "
                         "hybrid strategy (the ranks of one node)")
    else:
        return None
    if num_ranks % size:
        if required:
            GroupLayout(world_size=num_ranks, shard_group_size=size)  # raises: a node size that does not divide
        return None
    if not required and not 1 < size < num_ranks:
        return None
    return size
