"""The order of samples in an epoch and the cut of each global batch into ranks' rows, as pure
functions of ``(seed, epoch)`` and the sizes (no process group, no dataset).

[Note: global batch order] An epoch is a permutation of the dataset's indices drawn from a generator
seeded by ``epoch_seed(seed, epoch)`` (or ``0..n-1`` when not shuffling). Global batch ``b`` is the
permutation's positions ``[b*G, (b+1)*G)``; rank ``r`` of ``N`` takes a contiguous run of its rows
by the even split rule (see [Note: even split of a batch]). Nothing here depends on the rank count
except the cut, so ``N`` ranks together see exactly the global batches one process sees, and a
position (epoch, batches consumed) means the same samples at any world size: that is what makes
resuming at another world size exact.

[Note: even split of a batch] A global batch of ``g`` samples on ``N`` ranks is cut as evenly as
possible, in rank order: every rank gets ``g // N`` rows and the first ``g % N`` ranks one more
(41 on 8 ranks: 6, 5, 5, 5, 5, 5, 5, 5; 3 on 8 ranks: 1, 1, 1 and five ranks with none). A full
global batch divides by ``N`` (unless ``allow_uneven``), so only an epoch's last, partial batch
(``drop_last=False``) can be uneven; a rank with no rows then gets a padding batch (see [Note:
padding batches] in :mod:`dspark.data.padding`). The ranks' real rows concatenated in rank order are
the global batch in order, which is what :func:`dspark.gather_for_metrics` relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BatchInfo",
    "check_batch_size_value",
    "check_global_batch_size",
    "epoch_order",
    "epoch_seed",
    "global_batch_sizes",
    "local_rows",
    "local_sizes",
    "smaller_batch_fix",
]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchInfo:
    """Where one batch sits: which epoch and global batch it is, how many samples the whole global
    batch holds and how many of them are this rank's (``local_size`` rows, from row ``local_start``
    of the global batch). A loss weighted by real sample counts weighs this rank's mean by
    ``local_size / global_size`` times the world size."""

    epoch: int
    """Epoch the batch belongs to (0-based)."""
    index: int
    """Global batch index within the epoch (0-based)."""
    global_size: int
    """Samples in the global batch, over all ranks (less than ``global_batch_size`` only for the
    last batch of an epoch with ``drop_last=False``)."""
    local_size: int
    """Samples of it on this rank (real rows, padding not counted)."""
    local_start: int
    """This rank's first row within the global batch."""
    padding: int = 0
    """Rows of this rank's batch that are padding: a rank with no rows of a last, partial global batch
    gets a copy of one of its samples (``local_size`` 0, ``padding`` 1); see [Note: padding batches]
    in :mod:`dspark.data.padding`."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch: a 64-bit mix of ``seed`` and ``epoch``, so that no two
    ``(seed, epoch)`` pairs share a stream the way ``seed + epoch`` would (seed 0 epoch 1 vs seed 1
    epoch 0).

    Example::

        epoch_seed(0, 1) != epoch_seed(1, 0)   # True
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64))


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The dataset indices of one epoch, in the order they are served (int64, length
    ``num_samples``); a function of ``(seed, epoch)`` only.

    Example::

        epoch_order(5, seed=0, epoch=0, shuffle=False)   # tensor([0, 1, 2, 3, 4])
    """
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def global_batch_sizes(num_samples: int, global_batch_size: int, *, drop_last: bool) -> list[int]:
    """Sizes of the global batches of one epoch: full ones, then the remainder unless ``drop_last``.

    Example::

        global_batch_sizes(10, 4, drop_last=False)   # [4, 4, 2]
    """
    full, tail = divmod(num_samples, global_batch_size)
    return [global_batch_size] * full + ([tail] if tail and not drop_last else [])


def local_sizes(global_size: int, world_size: int) -> list[int]:
    """Rows of each rank in a global batch of ``global_size`` samples (see
    [Note: even split of a batch]).

    Example::

        local_sizes(41, 8)   # [6, 5, 5, 5, 5, 5, 5, 5]
    """
    base, extra = divmod(global_size, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def local_rows(global_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s rows in a global batch of ``global_size`` samples.

    Example::

        local_rows(7, 2, 1)   # (4, 7)
    """
    base, extra = divmod(global_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _sizes_text(global_size: int, world_size: int) -> str:
    return "+".join(map(str, local_sizes(global_size, world_size)))


def _nearest_multiples(size: int, world_size: int) -> str:
    lower = size - size % world_size
    return f"{lower} or {lower + world_size}" if lower else f"{world_size}"


def check_batch_size_value(global_batch_size: object) -> None:
    """Raise ``ValueError`` unless ``global_batch_size`` is an int >= 1: the part of
    :func:`check_global_batch_size` that needs no world size (so it holds before ``dspark.init()``)."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size!r} must be an int >= 1 (samples per "
                         "optimizer step, summed over all ranks)")


def check_global_batch_size(global_batch_size: int, world_size: int, *, allow_uneven: bool) -> None:
    """Raise ``ValueError`` unless every rank gets the same number of rows of a full global batch
    (or, with ``allow_uneven``, at least one row by the even split rule).

    Example::

        check_global_batch_size(10, 4, allow_uneven=False)
        # ValueError: global_batch_size=10 does not divide by world size 4 ... 8 or 12 ...
    """
    check_batch_size_value(global_batch_size)
    valid = _nearest_multiples(global_batch_size, world_size)
    if global_batch_size % world_size and not allow_uneven:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide by world size {world_size}: ranks "
            f"would weigh different sample counts. Nearest valid sizes: {valid}; or pass "
            f"allow_uneven=True to split it as evenly as possible "
            f"({_sizes_text(global_batch_size, world_size)})")
    if global_batch_size < world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} on world size {world_size}: split as evenly as "
            f"possible ({_sizes_text(global_batch_size, world_size)}) rank(s) "
            f"{', '.join(map(str, range(global_batch_size, world_size)))} would get no rows in every step. "
            "Use a global "
            f"batch of {valid}")


def smaller_batch_fix(num_samples: int, world_size: int) -> str:
    """The fix for data of ``num_samples`` samples that do not fill one global batch, in words.

    Example::

        smaller_batch_fix(7, 2)   # 'Use a global_batch_size of at most 7 (a multiple of world size 2: 6)'
    """
    if num_samples == 0:
        return "The dataset is empty: check its path or filter"
    fits = num_samples - num_samples % world_size
    if not fits:
        return (f"Its {num_samples} sample(s) cannot give each of the {world_size} ranks a row: use more "
                "data, or fewer ranks")
    return f"Use a global_batch_size of at most {num_samples} (a multiple of world size {world_size}: {fits})"
