"""Placements: how a distributed tensor is laid out across ranks. They fail closed.

``Shard(dim)`` splits along ``dim``; ``Replicate()`` copies the whole tensor on every rank. There is
no default and no ``None``: replication must be spelled out (``shard_dim=dspark.REPLICATE``), since
a silent replication is exactly the bug that doubles memory and makes N devices slower than one.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from dspark.errors import PlacementError

__all__ = ["REPLICATE", "Placement", "PlacementError", "Replicate", "Shard", "to_placement"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Split along tensor dimension ``dim`` (non-negative once normalised)."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise PlacementError(f"Shard(dim={self.dim!r}): dim must be an int, got "
                                 f"{type(self.dim).__name__}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    """The whole tensor on every rank."""

    def __str__(self) -> str:
        return "R"


Placement = Shard | Replicate
REPLICATE = Replicate()


def _fix(ndim: int) -> str:
    if not ndim:  # a 0-d tensor has no dim to split, so only one spelling can work
        return ("a 0-d tensor has no dim to split (shard_dim=<int> needs at least 1 dim); "
                "pass shard_dim=dspark.REPLICATE to copy it on every rank")
    return (f"pass shard_dim=<int> in [{-ndim}, {ndim - 1}] to split it across ranks, "
            f"or shard_dim=dspark.REPLICATE to copy it on every rank")


def to_placement(shard_dim: object, shape: Sequence[int], *, what: str = "tensor") -> Placement:
    """Turn the user's ``shard_dim`` into a placement for a tensor of ``shape``.

    Accepts an int (negative dims count from the end), :class:`Shard` or :class:`Replicate`.
    Anything else (``None``, bool, float, str, a dim out of range) raises :class:`PlacementError`
    naming the shape, the value and the two valid spellings.

    Example::

        to_placement(-1, (4, 8))         # Shard(dim=1)
        to_placement(REPLICATE, (4, 8))  # Replicate()
    """
    shape = tuple(int(s) for s in shape)
    ndim = len(shape)
    where = f"{what} of shape {shape}"
    if isinstance(shard_dim, Replicate):
        return shard_dim
    if shard_dim is None:
        raise PlacementError(
            f"{where}: shard_dim=None is not a placement (DSpark never replicates by default); "
            + _fix(ndim))
    if isinstance(shard_dim, Shard):
        dim = shard_dim.dim
    elif isinstance(shard_dim, bool) or not isinstance(shard_dim, numbers.Integral):
        raise PlacementError(
            f"{where}: shard_dim={shard_dim!r} ({type(shard_dim).__name__}) is not a placement; "
            + _fix(ndim))
    else:
        dim = int(shard_dim)
    if not -ndim <= dim < ndim:
        raise PlacementError(
            f"{where}: shard_dim={shard_dim!r} is out of range for {ndim} dims; " + _fix(ndim))
    return Shard(dim % ndim)
