"""Splitting a global batch across ranks (strong scaling: each rank keeps 1/N of it)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from dspark import comm
from dspark.tensor.placement import PlacementError, Replicate, to_placement
from dspark.tensor.shard_math import shard_range

__all__ = ["distribute_batch"]

B = TypeVar("B")

Leaf = torch.Tensor | np.ndarray
"""What has rows to split: a tensor, or a numpy array (labels from pandas, features from numpy)."""


def _is_array(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.ndim > 0)


def _is_row_list(value: Any) -> bool:
    """A list or tuple of plain values (strings, numbers): one per sample when its length is the
    batch's (a batch's raw texts or ids beside its tensors)."""
    return (isinstance(value, (list, tuple)) and not hasattr(value, "_fields") and len(value) > 0
            and not any(isinstance(v, (torch.Tensor, np.ndarray, Mapping, list, tuple))
                        or dataclasses.is_dataclass(v) for v in value))


def _dataclass_fields(value: Any) -> list[str]:
    """The init fields of a dataclass instance (what ``dataclasses.replace`` can set), else []."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [f.name for f in dataclasses.fields(value) if f.init]
    return []


def _leaves(batch: Any, path: str) -> list[tuple[str, Leaf]]:
    if _is_array(batch):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [leaf for k, v in batch.items() for leaf in _leaves(v, f"{path}[{k!r}]")]
    if isinstance(batch, (tuple, list)):
        return [leaf for i, v in enumerate(batch) for leaf in _leaves(v, f"{path}[{i}]")]
    return [leaf for name in _dataclass_fields(batch)
            for leaf in _leaves(getattr(batch, name), f"{path}.{name}")]


def _map(batch: Any, fn: Any) -> Any:
    if _is_array(batch) or _is_row_list(batch):
        return fn(batch)
    if isinstance(batch, dict):
        # A shallow copy keeps a dict subclass's own state (defaultdict's factory), which
        # ``type(batch)(items)`` would pass as the wrong constructor argument.
        mapped = copy.copy(batch)
        mapped.update((k, _map(v, fn)) for k, v in batch.items())
        return mapped
    if isinstance(batch, Mapping):
        return type(batch)({k: _map(v, fn) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map(v, fn) for v in batch)
    names = _dataclass_fields(batch)
    if names:
        return dataclasses.replace(batch, **{n: _map(getattr(batch, n), fn) for n in names})
    return batch


def distribute_batch(batch: B, shard_dim: Any = 0, *, allow_uneven: bool = False) -> B:
    """Keep this rank's slice of every tensor in ``batch`` (a tensor, tuple/list, dict or dataclass,
    nested).

    Every rank passes the same global batch; all tensors must have the same size along
    ``shard_dim`` (a negative one counts from each tensor's own end). That size must divide by the world size, so that every rank's loss weighs the
    same number of samples; ``allow_uneven=True`` accepts any size and follows the uneven split
    rule of :mod:`dspark.tensor.shard_math` (first ranks get one more sample). numpy arrays are
    split as tensors are; a list or tuple of plain values (strings, numbers) as long as the batch
    (its raw texts, its ids) is split along with it when ``shard_dim`` is the batch's dim 0; other
    non-tensor values (scalars, a shorter list) pass through. ``shard_dim=dspark.REPLICATE`` keeps the whole batch on every rank (each rank
    then does all the work: only for comparisons). ``None`` raises :class:`dspark.PlacementError`.

    Example::

        x, y = dspark.distribute_batch((images, labels), shard_dim=0)
    """
    leaves = _leaves(batch, "batch")
    if not leaves:
        raise TypeError(f"distribute_batch found no tensor in a {type(batch).__name__}; pass a "
                        "tensor, or a tuple/list/dict/dataclass of tensors")
    first_path, first = leaves[0]
    placement = to_placement(shard_dim, tuple(first.shape), what=f"{first_path}")
    if isinstance(placement, Replicate):
        return batch
    dim = placement.dim
    size = first.shape[dim]

    def leaf_dim(leaf: Leaf, path: str = "batch") -> int:
        # Resolved per leaf, so that a negative dim counts from each tensor's own end (images
        # and labels differ in ndim) and the error echoes the value the caller gave.
        return to_placement(shard_dim, tuple(leaf.shape), what=path).dim  # type: ignore[union-attr]

    for path, leaf in leaves[1:]:
        own_dim = leaf_dim(leaf, path)
        if leaf.shape[own_dim] != size:
            raise PlacementError(f"{path} has {leaf.shape[own_dim]} rows along dim {own_dim}, but "
                                 f"{first_path} has {size}: every tensor of a batch needs the same size")
    world = comm.get_world()
    if size % world.world_size and not allow_uneven:
        lower = size - size % world.world_size
        # Below the world size the only even batch nearby is one sample per rank.
        sizes = f"{lower} or {lower + world.world_size}" if lower else f"{world.world_size}"
        raise PlacementError(
            f"a global batch of {size} along dim {dim} does not divide by world size "
            f"{world.world_size}: ranks would weigh different sample counts. Use a batch of "
            f"{sizes}, or pass allow_uneven=True")
    start, stop = shard_range(size, world.world_size, world.rank)

    def split(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.narrow(leaf_dim(leaf), start, stop - start)
        if isinstance(leaf, np.ndarray):
            own = leaf_dim(leaf)
            return leaf[(slice(None),) * own + (slice(start, stop),)]
        if dim == 0 and len(leaf) == size:   # one value per sample
            return type(leaf)(leaf[start:stop])
        return leaf

    return _map(batch, split)  # type: ignore[no-any-return]
