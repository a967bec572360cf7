"""Epoch order and batch cutting: pure logic, no process group."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.data.order import (
    check_global_batch_size,
    epoch_order,
    epoch_seed,
    global_batch_sizes,
    local_rows,
    local_sizes,
    smaller_batch_fix,
)
from tests.messages import assert_line_names, assert_names


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


def test_batches_split_as_evenly_as_possible_in_contiguous_rank_order() -> None:
    assert global_batch_sizes(10, 4, drop_last=False) == [4, 4, 2]
    assert global_batch_sizes(10, 4, drop_last=True) == [4, 4]
    assert local_sizes(41, 8) == [6, 5, 5, 5, 5, 5, 5, 5]  # 1001 % 64 on 8 ranks
    assert local_sizes(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]
    for size in range(0, 20):
        for num_ranks in (1, 2, 3, 4, 8):
            rows = [local_rows(size, num_ranks, r) for r in range(num_ranks)]
            assert rows[0][0] == 0 and rows[-1][1] == size  # contiguous, in rank order, all of it
            assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
            counts = [stop - start for start, stop in rows]
            assert counts == local_sizes(size, num_ranks) and max(counts) - min(counts) <= 1


def test_indivisible_global_batch_names_the_numbers_and_the_nearest_sizes() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=10.*world size 4.*8 or 12.*3\+3\+2\+2"):
        check_global_batch_size(10, 4, allow_uneven=False)
    check_global_batch_size(10, 4, allow_uneven=True)  # 3+3+2+2: every rank has rows
    check_global_batch_size(6, 4, allow_uneven=True)  # 2+2+1+1
    with pytest.raises(ValueError) as caught:
        check_global_batch_size(3, 4, allow_uneven=True)  # 1+1+1+0 in every step
    assert_names(str(caught.value), "rank(s) 3", "no rows")
    with pytest.raises(ValueError, match="must be an int >= 1"):
        check_global_batch_size(0, 2, allow_uneven=False)


def test_the_fix_for_too_little_data_can_be_applied() -> None:
    assert_line_names(smaller_batch_fix(7, 2), "at most 7", "world size 2: 6")
    assert "empty" in smaller_batch_fix(0, 2) and "at most 0" not in smaller_batch_fix(0, 2)
    assert_line_names(smaller_batch_fix(3, 4), "cannot", "4 ranks", "row")
