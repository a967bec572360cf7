"""The uneven split rule as pure arithmetic, checked against ``torch.chunk``. No process group."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dspark.tensor.shard_math import chunk_size, padded_size, shard_range, shard_shape, shard_sizes

sizes = st.integers(min_value=0, max_value=300)
rank_counts = st.integers(min_value=1, max_value=17)
fast = settings(deadline=None, max_examples=300)  # the box is shared: no per-example deadline


@pytest.mark.parametrize(("size", "num_ranks", "expected"), [
    (7, 2, (4, 3)), (1, 2, (1, 0)), (0, 2, (0, 0)), (8, 2, (4, 4)),
    (5, 4, (2, 2, 1, 0)), (6, 4, (2, 2, 2, 0)), (3, 1, (3,)),
])
def test_documented_examples(size: int, num_ranks: int, expected: tuple[int, ...]) -> None:
    assert shard_sizes(size, num_ranks) == expected


@fast
@given(size=sizes, num_ranks=rank_counts)
def test_sizes_sum_to_size_and_follow_the_ceil_rule(size: int, num_ranks: int) -> None:
    got = shard_sizes(size, num_ranks)
    c = chunk_size(size, num_ranks)
    assert len(got) == num_ranks and sum(got) == size
    assert c == 0 if size == 0 else (c - 1) * num_ranks < size <= c * num_ranks
    # Full chunks of c rows first, then at most one partial chunk, then empty ranks.
    full, partial = divmod(size, c) if c else (0, 0)
    want = [c] * full + ([partial] if partial else [])
    assert list(got) == want + [0] * (num_ranks - len(want))


@fast
@given(size=sizes, num_ranks=rank_counts)
@example(size=7, num_ranks=2)
@example(size=5, num_ranks=4)
@example(size=0, num_ranks=3)
@example(size=1, num_ranks=17)
def test_shards_match_torch_chunk_on_a_real_tensor(size: int, num_ranks: int) -> None:
    whole = torch.arange(size)
    chunks = torch.chunk(whole, num_ranks)  # may return fewer than num_ranks pieces
    assert len(chunks) <= num_ranks
    for rank in range(num_ranks):
        start, stop = shard_range(size, num_ranks, rank)
        want = chunks[rank] if rank < len(chunks) else whole[:0]
        assert torch.equal(whole[start:stop], want), (size, num_ranks, rank)


@fast
@given(size=sizes, num_ranks=rank_counts)
def test_ranges_are_contiguous_disjoint_and_cover_the_dim(size: int, num_ranks: int) -> None:
    ranges = [shard_range(size, num_ranks, r) for r in range(num_ranks)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    for (start, stop), (next_start, _) in itertools.pairwise(ranges):
        assert 0 <= start <= stop <= size
        assert stop == next_start  # no gap, no overlap
    assert [stop - start for start, stop in ranges] == list(shard_sizes(size, num_ranks))


@fast
@given(size=sizes, num_ranks=rank_counts)
def test_padded_size_gives_every_rank_one_chunk(size: int, num_ranks: int) -> None:
    padded = padded_size(size, num_ranks)
    assert padded == chunk_size(size, num_ranks) * num_ranks
    assert size <= padded < size + num_ranks
    assert padded % num_ranks == 0
    assert max(shard_sizes(size, num_ranks)) == chunk_size(size, num_ranks)


@fast
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=4), num_ranks=rank_counts,
       data=st.data())
def test_shard_shape_changes_only_the_split_dim(shape: list[int], num_ranks: int,
                                                data: st.DataObject) -> None:
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    rank = data.draw(st.integers(0, num_ranks - 1))
    got = shard_shape(shape, dim, num_ranks, rank)
    want = list(shape)
    want[dim] = shard_sizes(shape[dim], num_ranks)[rank]
    assert got == tuple(want)
    chunks = torch.empty(shape).chunk(num_ranks, dim)
    if rank < len(chunks):  # torch.chunk leaves out the trailing empty shards
        assert got == tuple(chunks[rank].shape)
    else:
        assert got[dim] == 0


@pytest.mark.parametrize(("fn", "args", "error", "match"), [
    (chunk_size, (4, 0), ValueError, "num_ranks=0 must be >= 1"),
    (chunk_size, (-1, 2), ValueError, "size=-1 must be >= 0"),
    (padded_size, (3, -2), ValueError, "num_ranks=-2"),
    (shard_sizes, (3, 0), ValueError, "num_ranks=0"),
    (shard_range, (4, 2, 2), ValueError, r"rank=2 is outside \[0, 2\)"),
    (shard_range, (4, 2, -1), ValueError, r"rank=-1 is outside \[0, 2\)"),
    (shard_range, (4, 0, 0), ValueError, "num_ranks=0 must be >= 1"),
    (shard_shape, ((4, 6), 2, 2, 0), ValueError, r"dim=2 is out of range for shape \(4, 6\)"),
    (shard_shape, ((4, 6), -3, 2, 0), ValueError, "dim=-3 is out of range"),
    (shard_shape, ((4, 6), 0, 2, 5), ValueError, "rank=5"),
    (chunk_size, (4.0, 2), TypeError, r"size=4\.0 must be an int"),
    (chunk_size, (4, 2.0), TypeError, "num_ranks=2.0 must be an int"),
    (chunk_size, (True, 2), TypeError, "size=True must be an int"),
    (shard_range, (4, 2, 0.0), TypeError, "rank=0.0 must be an int"),
    (shard_shape, ((4, 6), 1.0, 2, 0), TypeError, "dim=1.0 must be an int"),
])
def test_bad_inputs_raise_with_the_value(fn: Callable[..., object], args: tuple[object, ...],
                                         error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fn(*args)
