"""Shard arithmetic as pure functions (no process group).

[Note: uneven split rule] A dimension of size ``n`` on ``N`` ranks is cut in chunks of
``c = ceil(n / N)`` rows: rank ``r`` holds rows ``[min(r*c, n), min((r+1)*c, n))``. The first ranks
hold ``c`` rows, later ones fewer or none (7 rows on 2 ranks: 4 + 3; 5 on 4: 2, 2, 1, 0). This is
``torch.chunk``'s rule and PyTorch DTensor's, so shards convert to DTensors as they are. Padding
every shard to ``c`` rows gives equal-sized pieces for collectives.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = [
    "chunk_size",
    "padded_size",
    "shard_range",
    "shard_shape",
    "shard_sizes",
]


def _check_int(name: str, value: object) -> None:
    # A float would flow through ``//`` and come back as fractional row counts; bool is an int
    # to Python but never a row count.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")


def _check(size: int, num_ranks: int) -> None:
    _check_int("size", size)
    _check_int("num_ranks", num_ranks)
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks} must be >= 1")
    if size < 0:
        raise ValueError(f"size={size} must be >= 0")


def chunk_size(size: int, num_ranks: int) -> int:
    """Rows of the largest shard: ``ceil(size / num_ranks)``."""
    _check(size, num_ranks)
    return -(-size // num_ranks)


def padded_size(size: int, num_ranks: int) -> int:
    """``size`` rounded up so that every rank holds :func:`chunk_size` rows."""
    return chunk_size(size, num_ranks) * num_ranks


def shard_range(size: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of the rows ``rank`` holds (see the uneven split rule)."""
    c = chunk_size(size, num_ranks)  # validates size and num_ranks before rank is judged by them
    _check_int("rank", rank)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank} is outside [0, {num_ranks})")
    return min(rank * c, size), min((rank + 1) * c, size)


def shard_sizes(size: int, num_ranks: int) -> tuple[int, ...]:
    """Rows per rank; they sum to ``size``."""
    _check(size, num_ranks)  # with no ranks the loop below would return () instead of failing
    return tuple(stop - start for start, stop in
                 (shard_range(size, num_ranks, r) for r in range(num_ranks)))


def shard_shape(shape: Sequence[int], dim: int, num_ranks: int, rank: int) -> tuple[int, ...]:
    """Shape of ``rank``'s shard of a tensor of ``shape`` split along ``dim``."""
    _check_int("dim", dim)
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim={dim} is out of range for shape {tuple(shape)} "
                         f"(valid: [{-len(shape)}, {len(shape) - 1}])")
    start, stop = shard_range(shape[dim], num_ranks, rank)
    out = list(shape)
    out[dim] = stop - start
    return tuple(out)
