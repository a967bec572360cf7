"""Byte and call counters per collective kind (pure bookkeeping, no process group).

``bytes`` is the payload this rank hands to the collective: the input tensor's size (for
``all_gather`` the local shard, for ``reduce_scatter`` the whole input). ``wire_bytes`` is what a
ring algorithm puts on the wire from this rank, the figure a cost model needs:

* all_reduce: 2 * (N - 1) / N * size
* reduce_scatter: (N - 1) / N * input size
* all_gather: (N - 1) * shard size
* broadcast: size (counted on every rank)
Nothing is counted as sent when the world has one rank.

Each count is kept in total and per group name (``"world"`` for the default group, ``"shard"`` and
``"replica"`` for hybrid sharding's groups: :func:`dspark.comm.partition_groups`), so that what each
level of a two-level fabric carries can be read apart: ``stats(group="replica")``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["CollectiveStats", "name_group", "record", "reset_stats", "stats", "wire_bytes"]


@dataclass(slots=True)
class CollectiveStats:
    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0


_lock = threading.Lock()
_stats: dict[str, CollectiveStats] = {}
_by_group: dict[str, dict[str, CollectiveStats]] = {}
_group_names = {"world", "shard", "replica"}   # the names stats(group=) knows, counted on or not


def wire_bytes(kind: str, payload_bytes: int, num_ranks: int) -> int:
    """Bytes a ring implementation of ``kind`` sends from one rank."""
    if num_ranks <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (num_ranks - 1) * payload_bytes // num_ranks
    if kind == "reduce_scatter":
        return (num_ranks - 1) * payload_bytes // num_ranks
    if kind == "all_gather":
        return (num_ranks - 1) * payload_bytes
    return payload_bytes


def record(kind: str, payload_bytes: int, num_ranks: int, group: str = "world") -> None:
    """Count one ``kind`` collective of ``payload_bytes`` over ``num_ranks`` ranks of ``group``."""
    sent = payload_bytes if num_ranks > 1 else 0
    wire = wire_bytes(kind, sent, num_ranks)
    with _lock:
        _group_names.add(group)
        for table in (_stats, _by_group.setdefault(group, {})):
            entry = table.setdefault(kind, CollectiveStats())
            entry.calls += 1
            entry.bytes += sent
            entry.wire_bytes += wire


def stats(group: str | None = None) -> dict[str, CollectiveStats]:
    """A snapshot of the counters since the last :func:`reset_stats`, by collective kind: over every
    group, or only ``group``'s (``"world"``, ``"shard"``, ``"replica"``...).

    Example::

        comm.stats(group="replica")["all_reduce"].wire_bytes   # what crossed the nodes
    """
    with _lock:
        if group is not None and group not in _group_names:
            raise ValueError(f"group={group!r} names no group of DSpark's comm layer: pass one of "
                             f"{', '.join(map(repr, sorted(_group_names)))} (a new_group's name=), or None for all")
        table = _stats if group is None else _by_group.get(group, {})
        return {k: CollectiveStats(v.calls, v.bytes, v.wire_bytes) for k, v in table.items()}


def name_group(name: str) -> None:
    """Make ``name`` known to :func:`stats` before any collective is counted under it."""
    with _lock:
        _group_names.add(name)


def reset_stats() -> None:
    with _lock:
        _stats.clear()
        _by_group.clear()
