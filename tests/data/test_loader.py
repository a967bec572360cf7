"""dspark.DataLoader without a process group: each rank is simulated by passing rank/world_size.

The reference is plain PyTorch where it has an equivalent (no shuffle), and otherwise the loader's
own world-size-1 batches, which the other tests pin down: every epoch a permutation, each epoch new.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset, TensorDataset

import dspark
from tests.messages import assert_names

NUM_SAMPLES = 30


def _dataset(n: int = NUM_SAMPLES) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


def _ids(batches: list[list[torch.Tensor]]) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


def _loaders(world_size: int, **kwargs: object) -> list[dspark.DataLoader]:
    dataset = kwargs.pop("dataset", None) or _dataset()
    return [dspark.DataLoader(dataset, rank=r, world_size=world_size, **kwargs)  # type: ignore[arg-type]
            for r in range(world_size)]


def _concat(lists: object) -> list[int]:
    return [i for part in lists for i in part]  # type: ignore[attr-defined]


def _epoch(loaders: list[dspark.DataLoader]) -> list[list[int]]:
    """One pass of every rank's loader, as global batches: the ranks' rows concatenated in rank order."""
    per_rank = [_ids(list(loader)) for loader in loaders]
    assert len({len(p) for p in per_rank}) == 1, [len(p) for p in per_rank]
    return [_concat(p[i] for p in per_rank) for i in range(len(per_rank[0]))]


@pytest.mark.parametrize("drop_last", [True, False])
def test_without_shuffle_one_rank_serves_what_a_plain_torch_loader_serves(drop_last: bool) -> None:
    (mine,) = _loaders(1, global_batch_size=8, shuffle=False, drop_last=drop_last)
    plain = TorchDataLoader(_dataset(), batch_size=8, shuffle=False, drop_last=drop_last)
    got, want = list(mine), list(plain)
    assert len(got) == len(want) == len(mine)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_ranks_cover_an_epoch_disjointly_and_completely(world_size: int, drop_last: bool) -> None:
    loaders = _loaders(world_size, global_batch_size=6, seed=5, drop_last=drop_last)
    for _ in range(2):  # two epochs
        seen = [i for batch in _epoch(loaders) for i in batch]
        assert len(seen) == len(set(seen))
        assert len(seen) == (NUM_SAMPLES if not drop_last else NUM_SAMPLES - NUM_SAMPLES % 6)
    assert all(loader.epoch == 2 and loader.batches_consumed == 0 for loader in loaders)


@pytest.mark.parametrize(("world_size", "drop_last"), [(2, False), (4, True)])
def test_n_ranks_see_the_global_batches_one_process_sees(world_size: int, drop_last: bool) -> None:
    (one,) = _loaders(1, global_batch_size=8, seed=7, drop_last=drop_last)
    many = _loaders(world_size, global_batch_size=8, seed=7, drop_last=drop_last)
    for _ in range(2):
        assert _epoch(many) == _epoch([one])
    first, second = _epoch([one]), _epoch([one])
    assert first != second  # every epoch reshuffles by itself
    if not drop_last:
        assert sorted(_concat(first)) == sorted(_concat(second)) == list(range(NUM_SAMPLES))


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    a, b = _loaders(1, global_batch_size=10, seed=1) + _loaders(1, global_batch_size=10, seed=1)
    torch.manual_seed(123)
    first = _epoch([a])
    torch.manual_seed(456)  # torch's global generator plays no part, and is not drawn from
    state = torch.random.get_rng_state()
    assert _epoch([b]) == first
    assert torch.equal(torch.random.get_rng_state(), state)
    (other,) = _loaders(1, global_batch_size=10, seed=2)
    assert _epoch([other]) != first


def test_batch_info_tells_global_and_local_sizes() -> None:
    loader = dspark.DataLoader(_dataset(), global_batch_size=8, shuffle=False, drop_last=False,
                               rank=1, world_size=2)
    assert loader.batch_info is None and loader.local_batch_size == 4
    infos = []
    for x, _ in loader:
        infos.append(loader.batch_info)
        assert loader.batch_info is not None and loader.batch_info.local_size == len(x)
    assert [(i.index, i.global_size, i.local_size, i.local_start) for i in infos] == [
        (0, 8, 4, 4), (1, 8, 4, 4), (2, 8, 4, 4), (3, 6, 3, 3)]


def _resume(before_world: int, after_world: int, *, dataset: object = None, shuffle: bool = True,
            stop_after: int = 2) -> None:
    """Stop a run mid-epoch, save the state as JSON, resume at another world size: the rest of the
    epoch and the next one are exactly what the uninterrupted run serves."""
    kwargs = dict(global_batch_size=4, seed=11, shuffle=shuffle, drop_last=False)
    if dataset is not None:
        kwargs["dataset"] = dataset
    (whole,) = _loaders(1, **kwargs)
    uninterrupted = _epoch([whole]) + _epoch([whole])

    first = _loaders(before_world, **kwargs)
    iterators = [iter(loader) for loader in first]
    served = [_concat(next(it)[0].tolist() for it in iterators) for _ in range(stop_after)]
    states = [json.loads(json.dumps(loader.state_dict())) for loader in first]
    assert all(s == states[0] for s in states)  # global: no rank in it
    assert states[0]["epoch"] == 0 and states[0]["batches_consumed"] == stop_after

    resumed = _loaders(after_world, **kwargs)
    for loader in resumed:
        loader.load_state_dict(states[0])
    rest = _epoch(resumed) + _epoch(resumed)
    assert served + rest == uninterrupted


@pytest.mark.parametrize(("before", "after"), [(1, 1), (2, 2), (1, 2), (2, 1)])
def test_resume_mid_epoch_at_the_same_and_another_world_size(before: int, after: int) -> None:
    _resume(before, after)


def test_iterating_again_continues_after_a_break_and_starts_a_new_epoch_after_a_full_pass() -> None:
    (loader,) = _loaders(1, global_batch_size=10, seed=3)
    (reference,) = _loaders(1, global_batch_size=10, seed=3)
    full = _epoch([reference]) + _epoch([reference])
    got = []
    for batch in loader:
        got.append(batch[0].tolist())
        break
    assert loader.state_dict()["batches_consumed"] == 1
    got += _ids(list(loader))  # the rest of epoch 0
    assert loader.epoch == 1
    got += _ids(list(loader))  # epoch 1
    assert got == full


def test_a_state_saved_after_the_last_batch_resumes_at_the_next_epoch() -> None:
    (loader,) = _loaders(1, global_batch_size=10, seed=3)
    for _ in loader:
        state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (1, 0)


def test_a_stale_iterator_and_a_mismatched_state_are_errors() -> None:
    (loader,) = _loaders(1, global_batch_size=10)
    old = iter(loader)
    next(old)
    new = iter(loader)
    with pytest.raises(RuntimeError, match="stale"):
        next(old)
    next(new)
    unstarted = iter(loader)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="stale"):
        next(unstarted)
    state = loader.state_dict() | {"seed": 9}
    with pytest.raises(ValueError, match=r"seed=9 \(this loader: 0\)"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="lacks epoch"):
        loader.load_state_dict({"seed": 0})


def test_user_errors_name_the_numbers_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=10.*world size 4.*8 or 12"):
        _loaders(4, global_batch_size=10)
    with pytest.raises(ValueError) as caught:
        _loaders(4, global_batch_size=64)
    assert_names(str(caught.value), "30 samples", "global batch of 64", "at most 30", "world size 4: 28")
    with pytest.raises(TypeError, match=r"no batch_size=.*global_batch_size="):
        dspark.DataLoader(_dataset(), batch_size=8, rank=0, world_size=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="takes no sampler="):
        dspark.DataLoader(_dataset(), global_batch_size=8, sampler=None, rank=0, world_size=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError) as caught:
        dspark.DataLoader(_Stream(20), global_batch_size=4, rank=0, world_size=1)
    assert_names(str(caught.value), "shuffle=True", "iterable")
    with pytest.raises(ValueError, match="pass both, or neither"):
        dspark.DataLoader(_dataset(), global_batch_size=8, rank=0)


@pytest.mark.parametrize("size", [0, -4, 2.5, "8", True])
def test_a_wrong_global_batch_size_is_named_before_dspark_is_initialised(size: object) -> None:
    """No world here (no dspark.init(), no rank=/world_size=): the value itself is the error."""
    assert not dspark.comm.is_initialized()
    with pytest.raises(ValueError) as caught:
        dspark.DataLoader(_dataset(), global_batch_size=size)  # type: ignore[arg-type]
    assert_names(str(caught.value), f"global_batch_size={size!r}", ">= 1")


class _Stream(IterableDataset):
    """A stream of ``(i, 10*i)`` samples whose order depends on the epoch it is told."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist():
            yield torch.tensor(i), torch.tensor(10 * i)


@pytest.mark.parametrize("drop_last", [True, False])
def test_iterable_dataset_ranks_take_their_rows_of_the_plain_torch_batches(drop_last: bool) -> None:
    stream = _Stream(NUM_SAMPLES)
    plain = _ids(list(TorchDataLoader(stream, batch_size=8, drop_last=drop_last)))
    many = _loaders(2, dataset=stream, global_batch_size=8, shuffle=False, drop_last=drop_last)
    assert _epoch(many) == plain
    assert all(loader.epoch == 1 for loader in many)
    stream.set_epoch(1)
    assert _epoch(many) == _ids(list(TorchDataLoader(stream, batch_size=8, drop_last=drop_last)))


def test_iterable_dataset_resumes_mid_epoch_at_another_world_size() -> None:
    _resume(2, 1, dataset=_Stream(NUM_SAMPLES), shuffle=False, stop_after=3)
    _resume(1, 2, dataset=_Stream(NUM_SAMPLES), shuffle=False, stop_after=1)


def test_iterable_dataset_smaller_than_one_global_batch_is_an_error() -> None:
    loader = dspark.DataLoader(_Stream(3), global_batch_size=4, shuffle=False, rank=0, world_size=2)
    with pytest.raises(ValueError) as caught:
        list(loader)
    assert_names(str(caught.value), "3 samples", "epoch 0", "global batch of 4")


@pytest.mark.parametrize("iterable", [False, True])
def test_workers_serve_the_same_batches_in_the_same_order(iterable: bool) -> None:
    dataset = _Stream(NUM_SAMPLES) if iterable else _dataset()
    kwargs = dict(dataset=dataset, global_batch_size=4, seed=2, shuffle=not iterable, drop_last=False)
    in_process = _loaders(2, **kwargs)
    with_workers = _loaders(2, num_workers=2, **kwargs)
    assert _epoch(with_workers) == _epoch(in_process)
    assert _epoch(with_workers) == _epoch(in_process)  # the second epoch too


class _SplitsByWorker(IterableDataset):
    """PyTorch's docstring pattern: each worker reads only its part of ``range(n)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.tensor(i), torch.tensor(10 * i)


def test_a_dataset_that_splits_itself_by_worker_loses_nothing() -> None:
    """Each worker keeps every W-th global batch of the stream it reads: a dataset that also split
    itself by worker served half of the data with 2 workers, and said nothing."""
    kwargs = dict(dataset=_SplitsByWorker(NUM_SAMPLES), global_batch_size=4, shuffle=False)
    with_workers = _epoch(_loaders(2, num_workers=2, **kwargs))
    assert with_workers == _epoch(_loaders(2, **kwargs))
    assert sorted(_concat(with_workers)) == list(range(NUM_SAMPLES - NUM_SAMPLES % 4))
