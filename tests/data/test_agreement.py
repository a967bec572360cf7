"""Ranks whose data differ stop at once instead of drifting apart (issue 31, finding 4): a dataset
whose length differs between ranks (64 on rank 0, 48 on rank 1), another seed or position, or an
iterable stream that ends early on one rank is an error on every rank, naming the ranks and values,
before a batch of the differing epoch is served."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import dspark
from tests.messages import assert_line_names, assert_names

_UNREADABLE = "rank 1's shard is unreadable"
"""What the stream raises on rank 1 (every rank's error names it)."""


def _errors(failed: pytest.ExceptionInfo[AssertionError], kind: str = "ValueError") -> list[str]:
    errors = [line for line in failed.value.args[0].splitlines() if line.startswith(kind)]
    assert len(errors) == 2, failed.value.args[0]  # every rank stops, not only the odd one
    return errors


def _lengths_64_and_48() -> int:
    rank = dspark.get_world().rank
    loader = dspark.DataLoader(TensorDataset(torch.arange(64 if rank == 0 else 48)), global_batch_size=8)
    served = 0
    for _ in loader:  # before the finding's fix: 4 vs 3 batches per rank, each its own order
        served += 1
    return served


def test_dataset_lengths_that_differ_between_ranks_stop_every_rank(pool) -> None:
    with pytest.raises(AssertionError) as failed:
        pool.run(_lengths_64_and_48)
    for error in _errors(failed):
        assert_line_names(error, "dataset length", "64 on rank 0", "48 on rank 1")


def _settings_differ(what: str) -> None:
    rank = dspark.get_world().rank
    seed = rank if what == "seed" else 0
    loader = dspark.DataLoader(TensorDataset(torch.arange(64)), global_batch_size=8, seed=seed)
    if what == "position" and rank == 1:
        loader.load_state_dict({**loader.state_dict(), "batches_consumed": 3})
    next(iter(loader))


@pytest.mark.parametrize(("what", "words"), [("seed", "seed: 0 on rank 0, 1 on rank 1"),
                                              ("position", "batches_consumed: 0 on rank 0, 3 on rank 1")])
def test_seed_or_position_that_differ_stop_every_rank(pool, what: str, words: str) -> None:
    with pytest.raises(AssertionError) as failed:
        pool.run(_settings_differ, what)
    assert all(words in error for error in _errors(failed))


class _Stream(IterableDataset[torch.Tensor]):
    """Rank 1's stream ends after ``short`` samples (a shard file shorter on one host)."""

    def __init__(self, short: int, fail: bool = False) -> None:
        self.short, self.fail = short, fail

    def __iter__(self) -> Iterator[torch.Tensor]:
        rank = dspark.get_world().rank
        for i in range(64):
            if rank == 1 and i == self.short:
                if self.fail:
                    raise OSError(_UNREADABLE)
                return
            yield torch.tensor(i)


def _stream_run(short: int, drop_last: bool, fail: bool = False) -> int:
    loader = dspark.DataLoader(_Stream(short, fail), global_batch_size=8, shuffle=False,
                               drop_last=drop_last)
    served = 0
    for _ in loader:
        served += 1
    return served


@pytest.mark.parametrize(("short", "drop_last", "words"), [
    (44, True, "ended on rank(s) 1 after 5 global batches of epoch 0, while rank(s) 0"),
    (44, False, "global batch 5 of epoch 0 of the iterable dataset holds 8 on rank 0, 4 on rank 1"),
    (48, False, "ended on rank(s) 1 after 6 global batches of epoch 0, while rank(s) 0"),
])
def test_a_stream_that_ends_early_on_one_rank_stops_every_rank_at_that_batch(
        pool, short: int, drop_last: bool, words: str) -> None:
    with pytest.raises(AssertionError) as failed:
        pool.run(_stream_run, short, drop_last)
    assert all(words in error for error in _errors(failed))


def test_a_stream_that_raises_on_one_rank_stops_the_other_at_once(pool) -> None:
    with pytest.raises(AssertionError) as failed:
        pool.run(_stream_run, 20, True, True, timeout=60)
    text = failed.value.args[0]
    assert_names(text, f"OSError: {_UNREADABLE}")  # the rank's own error, relayed
    assert_line_names(text, "RuntimeError: rank 0:", "global batch 2", "epoch 0", "iterable dataset",
                      "rank(s) 1")


def test_equal_streams_serve_in_step(pool) -> None:
    assert pool.run(_stream_run, 64, False) == [8, 8]


def _evaluation_on_rank_0_only() -> int:
    """DDP's `if master_process: estimate_loss()` kept, over a validation dspark.DataLoader."""
    rank = dspark.get_world().rank
    train = dspark.DataLoader(TensorDataset(torch.arange(64)), global_batch_size=8, seed=1337)
    val = dspark.DataLoader(TensorDataset(torch.arange(32)), global_batch_size=8, seed=1)
    next(iter(train))
    if rank == 0:
        for _ in val:
            pass
    return len(list(train))


def test_a_loader_iterated_on_one_rank_alone_is_named_as_such(pool) -> None:
    with pytest.raises(AssertionError) as failed:
        pool.run(_evaluation_on_rank_0_only)
    for error in _errors(failed):
        assert_line_names(error, "different passes", "rank 0: its pass", "test_agreement.py:",
                          "rank 1: its pass", "test_agreement.py:", "master_process")
        assert "seed" not in error.split("):")[0], error  # not the settings of two other loaders
