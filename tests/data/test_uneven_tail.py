"""drop_last=False accepts any dataset length (issue 30): the epoch's last, partial global batch is
split as evenly as possible, a rank with no rows of it gets a padding batch (one real sample of that
batch, marked as padding: no model is handed zero rows), and every sample is served exactly once per
epoch. Ranks are simulated with rank/world_size (no process group)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import dspark
from dspark.data.padding import current_batch_is_padding


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n).float().unsqueeze(1).repeat(1, 3))


class _Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.n):
            yield torch.tensor(i), torch.full((3,), float(i))


def _passes(dataset: object, world_size: int, **kwargs: object) -> list[list[tuple[torch.Tensor, int]]]:
    """One epoch on each simulated rank: (real ids, batch_info.local_size) per batch."""
    out = []
    for rank in range(world_size):
        loader = dspark.DataLoader(dataset, global_batch_size=64, drop_last=False, rank=rank,
                                   world_size=world_size, **kwargs)  # type: ignore[arg-type]
        batches = []
        for ids, features in loader:
            info = loader.batch_info
            assert info is not None and len(ids) == info.local_size + info.padding == len(features) > 0
            assert info.padding == 0 or info.local_size == 0  # all real or all padding
            assert current_batch_is_padding() == (info.padding > 0)
            assert features.shape[1:] == (3,) and features.dtype == torch.float32
            batches.append((ids[: info.local_size], info.local_size))
        assert not current_batch_is_padding()  # the end of a pass clears the mark
        out.append(batches)
    return out


@pytest.mark.parametrize(("num_samples", "world_size", "tail_sizes"), [
    (1001, 2, [21, 20]),                      # 1001 % 64 = 41
    (1001, 3, [14, 14, 13]),                  # global batch 64 on 3 ranks: allow_uneven
    (1001, 8, [6, 5, 5, 5, 5, 5, 5, 5]),
    (67, 8, [1, 1, 1, 0, 0, 0, 0, 0]),        # a tail of 3 on 8 ranks: five ranks get zero rows
])
@pytest.mark.parametrize("iterable", [False, True])
def test_every_sample_once_in_one_process_order(num_samples: int, world_size: int,
                                                tail_sizes: list[int], iterable: bool) -> None:
    dataset = _Stream(num_samples) if iterable else _dataset(num_samples)
    kwargs: dict[str, object] = {"shuffle": False} if iterable else {"shuffle": True, "seed": 3}
    (one,) = _passes(dataset, 1, **kwargs)
    many = _passes(dataset, world_size, allow_uneven=64 % world_size != 0, **kwargs)
    assert {len(p) for p in many} == {len(one)} == {-(-num_samples // 64)}
    assert [p[-1][1] for p in many] == tail_sizes
    for index, (whole, _) in enumerate(one):
        # the ranks' rows, concatenated in rank order, are the global batch one process sees
        assert torch.equal(torch.cat([p[index][0] for p in many]), whole)
    served = torch.cat([ids for p in many for ids, _ in p])
    assert sorted(served.tolist()) == list(range(num_samples))


def test_len_and_position_count_the_partial_batch() -> None:
    loader = dspark.DataLoader(_dataset(1001), global_batch_size=64, drop_last=False, rank=1,
                               world_size=2)
    assert len(loader) == 16
    for _ in loader:
        pass
    assert loader.batch_info is not None and (loader.batch_info.global_size,
                                              loader.batch_info.local_size,
                                              loader.batch_info.local_start) == (41, 20, 21)
    assert (loader.epoch, loader.batches_consumed) == (1, 0)


@pytest.mark.parametrize("iterable", [False, True])
def test_a_rank_with_no_rows_gets_a_real_sample_marked_as_padding(iterable: bool) -> None:
    # 3 samples, a global batch of 4 on 4 ranks: one partial batch; rank 3 has none of it
    dataset = _Stream(3) if iterable else _dataset(3)
    served = []
    for rank in range(4):
        loader = dspark.DataLoader(dataset, global_batch_size=4, drop_last=False, shuffle=False,
                                   rank=rank, world_size=4)
        ((ids, _),) = list(loader)
        info = loader.batch_info
        assert info is not None and (info.global_size, info.local_size) == (3, 1 if rank < 3 else 0)
        assert info.padding == (1 if rank == 3 else 0)
        served.append(ids.tolist())
    assert served == [[0], [1], [2], [0]]  # the padding is the batch's first sample
    with pytest.raises(ValueError, match="drop_last=False"):
        dspark.DataLoader(_dataset(3), global_batch_size=4, rank=0, world_size=4)  # drop_last=True
