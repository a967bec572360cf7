"""``RankStream``: this rank's rows of each global batch of an iterable dataset.

[Note: iterable datasets] An iterable dataset has no indices to permute, so the policy is: every rank
(and every worker of a rank) reads the same stream, one epoch of it per pass, and counts its samples.
Samples ``[b*G, (b+1)*G)`` of the stream form global batch ``b``; a rank keeps its rows of each by the
same even split rule as for map-style datasets, and worker ``w`` of ``W`` assembles the batches
``b`` with ``(b - start) % W == w``. PyTorch's DataLoader returns the workers' items round-robin
(worker 0's first, then worker 1's, ...), so the batches come back in order. The price: each worker
of each rank reads (and decodes) the whole stream, keeping only its rows; a stream that is expensive
to read is better served as a map-style dataset. Requirements on the dataset: the same stream on
every rank and in every worker for a given epoch (a dataset with ``set_epoch(epoch)`` is told the
epoch before each pass, so it can reshuffle itself as a function of it). Inside a worker, the
dataset's ``torch.utils.data.get_worker_info()`` returns None: one that splits itself by worker
(PyTorch's docstring pattern) reads the whole stream too instead of losing the other workers'
parts. Resuming at global batch ``k`` reads and skips the first ``k*G`` samples.

A last, partial global batch (``drop_last=False``) is split by the even split rule of its own size,
which is known only when the stream ends (a rank with no rows of it gets the batch's first sample as
padding, see [Note: padding batches] in :mod:`dspark.data.padding`); so with ``drop_last=False`` a
worker holds the raw samples of the global batch it is assembling (not collated), and with
``drop_last=True`` only its rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils import worker as _torch_worker

from dspark.data.order import BatchInfo, local_rows, smaller_batch_fix

__all__ = ["CollateWithInfo", "RankStream"]


class RankStream(IterableDataset[tuple[BatchInfo, list[Any]]]):
    """Wraps an iterable dataset: each item is ``(BatchInfo, samples)`` with this rank's samples of
    one global batch, for a PyTorch DataLoader with ``batch_size=None`` and :class:`CollateWithInfo`.

    Example::

        stream = RankStream(dataset, global_batch_size=8, rank=0, world_size=2, drop_last=True,
                            epoch=0, start_batch=0)
        info, samples = next(iter(stream))   # 4 samples: rows 0..3 of global batch 0
    """

    def __init__(self, dataset: Iterable[Any], *, global_batch_size: int, rank: int, world_size: int,
                 drop_last: bool, epoch: int, start_batch: int) -> None:
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = epoch
        self.start_batch = start_batch

    def __iter__(self) -> Iterator[tuple[BatchInfo, list[Any]]]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        hidden = _hide_worker_info()
        try:
            yield from self._batches(worker_id, num_workers)
        finally:
            _restore_worker_info(hidden)

    def _batches(self, worker_id: int, num_workers: int) -> Iterator[tuple[BatchInfo, list[Any]]]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        size = self.global_batch_size
        own_start, own_stop = local_rows(size, self.world_size, self.rank)
        samples = iter(self.dataset)
        index = 0
        while True:
            mine = index >= self.start_batch and (index - self.start_batch) % num_workers == worker_id
            keep_all = mine and not self.drop_last
            kept: list[Any] = []
            count = 0
            for sample in itertools.islice(samples, size):
                if keep_all or (mine and own_start <= count < own_stop):
                    kept.append(sample)
                count += 1
            if count == size:
                if mine:
                    rows = kept[own_start:own_stop] if keep_all else kept
                    yield BatchInfo(epoch=self.epoch, index=index, global_size=size,
                                    local_size=own_stop - own_start, local_start=own_start), rows
                index += 1
                continue
            if index == 0 and (self.drop_last or not count):
                raise ValueError(
                    f"the iterable dataset yielded {count} samples in epoch {self.epoch}, fewer than "
                    f"one global batch of {size}: no step could run. "
                    f"{smaller_batch_fix(count, self.world_size)}")
            if count and not self.drop_last and mine:
                start, stop = local_rows(count, self.world_size, self.rank)
                yield BatchInfo(epoch=self.epoch, index=index, global_size=count, local_size=stop - start,
                                local_start=start, padding=int(start == stop)), kept[start:stop] or kept[:1]
            return


def _hide_worker_info() -> Any:
    """Make ``torch.utils.data.get_worker_info()`` return None while the user's dataset is read, and
    return what it returned. A dataset that splits itself by worker (the pattern of PyTorch's
    ``IterableDataset`` docstring) would otherwise give each worker a part of the stream, of which
    this worker keeps every ``W``-th batch: most of the data would be lost, silently. Hidden, it
    reads the whole stream in every worker, which is what this policy needs (see [Note: iterable
    datasets]). The value lives in ``torch.utils.data._utils.worker``; where a PyTorch keeps it
    elsewhere, nothing is hidden."""
    if not hasattr(_torch_worker, "_worker_info"):
        return None
    info = _torch_worker._worker_info
    _torch_worker._worker_info = None
    return info


def _restore_worker_info(info: Any) -> None:
    if info is not None:
        _torch_worker._worker_info = info


class CollateWithInfo:
    """Collates the samples of a :class:`RankStream` item and keeps its :class:`BatchInfo` beside
    (a class, not a lambda, so that worker processes started by spawn can unpickle it)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, item: Any) -> tuple[BatchInfo, Any]:
        info, samples = item  # one (BatchInfo, samples) item of a RankStream
        return info, self.collate_fn(samples)
