"""Epoch order and batch cutting: pure logic, no process group."""

from __future__ import annotations

import pytest
import torch

from dspark.data.order import (
    check_global_batch_size,
    check_tail,
    epoch_order,
    epoch_seed,
    global_batch_sizes,
    local_rows,
    smaller_batch_fix,
)


def test_epoch_seeds_do_not_collide_the_way_a_sum_would() -> None:
    seeds = {epoch_seed(s, e) for s in range(20) for e in range(20)}
    assert len(seeds) == 400
    assert epoch_seed(0, 1) != epoch_seed(1, 0)


def test_an_epoch_is_a_permutation_that_depends_on_seed_and_epoch_only() -> None:
    a = epoch_order(100, seed=3, epoch=2, shuffle=True)
    assert sorted(a.tolist()) == list(range(100))
    assert torch.equal(a, epoch_order(100, seed=3, epoch=2, shuffle=True))
    assert not torch.equal(a, epoch_order(100, seed=3, epoch=3, shuffle=True))
    assert not torch.equal(a, epoch_order(100, seed=4, epoch=2, shuffle=True))
    assert epoch_order(5, seed=3, epoch=9, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_batch_sizes_and_rows_follow_torch_chunk() -> None:
    assert global_batch_sizes(10, 4, drop_last=False) == [4, 4, 2]
    assert global_batch_sizes(10, 4, drop_last=True) == [4, 4]
    rows = torch.arange(7)
    for num_ranks in (1, 2, 3, 4):
        chunks = rows.chunk(num_ranks)
        for rank, chunk in enumerate(chunks):
            start, stop = local_rows(7, num_ranks, rank)
            assert rows[start:stop].tolist() == chunk.tolist()


def test_indivisible_global_batch_names_the_numbers_and_the_nearest_sizes() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=10 does not divide by world size 4.*8 or 12"):
        check_global_batch_size(10, 4, allow_uneven=False)
    check_global_batch_size(10, 4, allow_uneven=True)  # 3+3+3+1: every rank has rows
    with pytest.raises(ValueError, match=r"rank\(s\) 3 would get no rows.*4 or 8"):
        check_global_batch_size(6, 4, allow_uneven=True)  # 2+2+2+0
    with pytest.raises(ValueError, match="must be an int >= 1"):
        check_global_batch_size(0, 2, allow_uneven=False)


def test_a_tail_that_leaves_a_rank_empty_is_an_error() -> None:
    check_tail(3, 8, 2)  # 2 + 1
    with pytest.raises(ValueError, match=r"holds 1 of 8 samples.*rank\(s\) 1 would get no rows.*drop_last=True"):
        check_tail(1, 8, 2)


def test_the_fix_for_too_little_data_can_be_applied() -> None:
    assert smaller_batch_fix(7, 2).endswith("at most 7 (a multiple of world size 2: 6)")
    assert "empty" in smaller_batch_fix(0, 2) and "at most 0" not in smaller_batch_fix(0, 2)
    assert "cannot give each of the 4 ranks a row" in smaller_batch_fix(3, 4)
