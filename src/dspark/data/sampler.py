"""``GlobalBatchSampler``: this rank's rows of each global batch of a map-style dataset, as lists of
dataset indices for ``torch.utils.data.DataLoader(batch_sampler=...)``."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

from dspark.data.order import BatchInfo, epoch_order, global_batch_sizes, local_rows

__all__ = ["GlobalBatchSampler"]


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for each global batch of the epoch at :attr:`epoch` from global batch
    :attr:`start_batch` on, the dataset indices of ``rank``'s rows (see
    [Note: global batch order] in :mod:`dspark.data.order`). The owner sets the position before each
    pass; the sampler itself keeps no count of what was consumed (workers prefetch ahead of that).
    A rank with no rows of a batch (a last, partial one smaller than the world) gets the index of the
    batch's first sample, as padding (see [Note: padding batches] in :mod:`dspark.data.padding`).

    Example::

        sampler = GlobalBatchSampler(10, global_batch_size=4, rank=1, world_size=2, shuffle=False,
                                     seed=0, drop_last=True)
        list(sampler)   # [[2, 3], [6, 7]]
    """

    def __init__(self, num_samples: int, *, global_batch_size: int, rank: int, world_size: int,
                 shuffle: bool, seed: int, drop_last: bool) -> None:
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.sizes = global_batch_sizes(num_samples, global_batch_size, drop_last=drop_last)
        """Samples in each global batch of an epoch (every epoch has the same sizes)."""
        self.epoch = 0
        self.start_batch = 0

    def batch_info(self, epoch: int, index: int) -> BatchInfo:
        """Where global batch ``index`` of ``epoch`` puts this rank's rows."""
        start, stop = local_rows(self.sizes[index], self.world_size, self.rank)
        return BatchInfo(epoch=epoch, index=index, global_size=self.sizes[index],
                         local_size=stop - start, local_start=start, padding=int(start == stop))

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_order(self.num_samples, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        offset = sum(self.sizes[: self.start_batch])
        for index in range(self.start_batch, len(self.sizes)):
            start, stop = local_rows(self.sizes[index], self.world_size, self.rank)
            if start == stop:  # no rows here: one sample of the batch, as padding
                start, stop = 0, 1
            yield order[offset + start: offset + stop].tolist()
            offset += self.sizes[index]

    def __len__(self) -> int:
        return len(self.sizes) - self.start_batch
