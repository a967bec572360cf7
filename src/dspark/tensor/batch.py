"""Walking a batch, and splitting a global batch across ranks (strong scaling: each rank keeps 1/N
of it)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from dspark import comm
from dspark.tensor.placement import PlacementError, Replicate, to_placement
from dspark.tensor.shard_math import shard_range

__all__ = ["batch_leaves", "distribute_batch", "map_batch", "split_batch"]

B = TypeVar("B")

Leaf = torch.Tensor | np.ndarray
"""What has rows to split: a tensor, or a numpy array (labels from pandas, features from numpy)."""


def _is_array(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.ndim > 0)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


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


def _children(batch: Any) -> list[tuple[str, Any]] | None:
    """[Note: walking a batch] The one set of rules by which DSpark looks into a batch (splitting it,
    fingerprinting it, recording a forward's inputs, zero3's unit inputs and outputs): a mapping's
    values in its order, a tuple's or list's items (named tuples included), a dataclass instance's
    init fields; anything else is a leaf. ``(path suffix, value)`` of each child, or None for a leaf."""
    if isinstance(batch, torch.Tensor):
        return None
    if isinstance(batch, Mapping):
        return [(f"[{k!r}]", v) for k, v in batch.items()]
    if isinstance(batch, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(batch)]
    names = _dataclass_fields(batch)
    return [(f".{name}", getattr(batch, name)) for name in names] if names else None


def _leaves(batch: Any, path: str, is_leaf: Callable[[Any], bool] = _is_array) -> list[tuple[str, Any]]:
    """``(path, value)`` of every leaf of ``batch`` that ``is_leaf`` accepts, in walking order."""
    if is_leaf(batch):
        return [(path, batch)]
    children = _children(batch)
    if children is None:
        return []
    return [leaf for suffix, value in children for leaf in _leaves(value, path + suffix, is_leaf)]


def batch_leaves(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch`` (a tensor, or nested mappings, tuples/lists and dataclasses; other
    values are skipped), in a stable order (see [Note: walking a batch]).

    Example::

        batch_leaves((x, {"mask": m}, 3))   # [x, m]
    """
    return [leaf for _, leaf in _leaves(batch, "batch", _is_tensor)]


def map_batch(batch: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] = _is_tensor) -> Any:
    """``batch`` with every leaf ``is_leaf`` accepts replaced by ``fn(leaf)``, containers rebuilt with
    their own types (a dict subclass keeps its state, a named tuple its fields, a dataclass its other
    fields) and other values passed through as the same objects.

    Example::

        map_batch({"x": x, "n": 3}, torch.Tensor.cpu)   # {"x": x.cpu(), "n": 3}
    """
    if is_leaf(batch):
        return fn(batch)
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        # A shallow copy keeps a dict subclass's own state (defaultdict's factory), which
        # ``type(batch)(items)`` would pass as the wrong constructor argument.
        mapped = copy.copy(batch)
        mapped.update((k, map_batch(v, fn, is_leaf)) for k, v in batch.items())
        return mapped
    if isinstance(batch, Mapping):
        return type(batch)({k: map_batch(v, fn, is_leaf) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_batch(v, fn, is_leaf) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_batch(v, fn, is_leaf) for v in batch)
    names = _dataclass_fields(batch)
    if names:
        return dataclasses.replace(batch, **{n: map_batch(getattr(batch, n), fn, is_leaf) for n in names})
    return batch


def distribute_batch(batch: B, shard_dim: Any = 0, *, allow_uneven: bool = False) -> B:
    """Keep this rank's slice of every tensor in ``batch`` (a tensor, tuple/list, dict or dataclass,
    nested).

    Every rank passes the same global batch; all tensors must have the same size along
    ``shard_dim`` (a negative one counts from each tensor's own end). That size must divide by the
    world size, so that every rank's loss weighs the same number of samples; ``allow_uneven=True``
    accepts any size and follows the uneven split rule of :mod:`dspark.tensor.shard_math` (first
    ranks get one more sample). numpy arrays are split as tensors are; a list or tuple of plain
    values (strings, numbers) as long as the batch (its raw texts, its ids) is split along with it
    when ``shard_dim`` is the batch's dim 0; other non-tensor values (scalars, a shorter list) pass
    through. ``shard_dim=dspark.REPLICATE`` keeps the whole batch on every rank (each rank then does
    all the work: only for comparisons). ``None`` raises :class:`dspark.PlacementError`.

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
    return _rows(batch, start, stop, size=size, dim_of=leaf_dim, row_lists=dim == 0)  # type: ignore[no-any-return]


def _rows(batch: Any, start: int, stop: int, *, size: int, dim_of: Callable[[Leaf], int],
          row_lists: bool) -> Any:
    """``batch`` with rows ``start:stop`` of every tensor and array (along ``dim_of(leaf)``) and,
    with ``row_lists``, of every list of one value per sample (``size`` of them); other values
    pass through as they are."""
    def take(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.narrow(dim_of(leaf), start, stop - start)
        if isinstance(leaf, np.ndarray):
            return leaf[(slice(None),) * dim_of(leaf) + (slice(start, stop),)]
        if row_lists and len(leaf) == size:   # one value per sample
            return type(leaf)(leaf[start:stop])
        return leaf

    return map_batch(batch, take, lambda v: _is_array(v) or _is_row_list(v))


def split_batch(batch: B, parts: int) -> list[B]:
    """``batch`` split along dim 0 into ``parts`` equal micro-batches, in order: every tensor and
    array, and every list of one value per sample; other values go to each part as they are. A
    ``ValueError`` names the rows when they do not divide by ``parts``.

    Example::

        for x, y in split_batch((x, y), 4):   # 4 micro-batches of len(x) // 4 rows
            engine.backward(loss_fn(engine(x), y))
    """
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts={parts!r} must be an int >= 1")
    leaves = _leaves(batch, "batch")
    if not leaves:
        raise ValueError("the batch holds no tensor or array to split into micro-batches")
    first_path, first = leaves[0]
    size = first.shape[0]
    for path, leaf in leaves[1:]:
        if leaf.shape[0] != size:
            raise ValueError(f"{path} has {leaf.shape[0]} rows, but {first_path} has {size}: every "
                             "tensor of a batch needs the same size along dim 0")
    if size % parts:
        raise ValueError(f"a batch of {size} rows does not split into {parts} equal micro-batches "
                         f"({size} % {parts} = {size % parts}); give each step a multiple of {parts} rows")
    rows = size // parts
    return [_rows(batch, i * rows, (i + 1) * rows, size=size, dim_of=lambda leaf: 0, row_lists=True)
            for i in range(parts)]
