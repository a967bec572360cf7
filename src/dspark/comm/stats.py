"""Byte and call counters per collective kind (pure bookkeeping, no process group).

``bytes`` is the payload this rank hands to the collective: the input tensor's size (for
``all_gather`` the local shard, for ``reduce_scatter`` the whole input). ``wire_bytes`` is what a
ring algorithm puts on the wire from this rank, the figure a cost model needs:

* all_reduce: 2 * (N - 1) / N * size
* reduce_scatter: (N - 1) / N * input size
* all_gather: (N - 1) * shard size
* broadcast: size (counted on every rank)
Nothing is counted as sent when the world has one rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["CollectiveStats", "record", "reset_stats", "stats", "wire_bytes"]


@dataclass(slots=True)
class CollectiveStats:
    calls: int = 0
    bytes: int = 0
    wire_bytes: int = 0


_lock = threading.Lock()
_stats: dict[str, CollectiveStats] = {}


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


def record(kind: str, payload_bytes: int, num_ranks: int) -> None:
    sent = payload_bytes if num_ranks > 1 else 0
    with _lock:
        entry = _stats.setdefault(kind, CollectiveStats())
        entry.calls += 1
        entry.bytes += sent
        entry.wire_bytes += wire_bytes(kind, sent, num_ranks)


def stats() -> dict[str, CollectiveStats]:
    """A snapshot of the counters since the last :func:`reset_stats`, by collective kind."""
    with _lock:
        return {k: CollectiveStats(v.calls, v.bytes, v.wire_bytes) for k, v in _stats.items()}


def reset_stats() -> None:
    with _lock:
        _stats.clear()
