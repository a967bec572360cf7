"""A checkpoint loads at another world size and into another strategy: the resumed step lands where
the uninterrupted run did (up to the rounding of summing gradients over 1 vs 2 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.ranks import SAVED_LR, SAVED_STEPS, load_then_continue, save_then_continue
from tests.engine.harness import rel_error

TOLERANCE = 1e-6
"""Relative parameter error after the resumed step; a lost optimizer state or a wrong row is ~1e-2."""


def test_two_ranks_zero3_to_one_rank_replicate(pool, single_process, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    want = pool.run(save_then_continue, path, "mlp", "zero3")[0]["state"]
    got = load_then_continue(path, "mlp", "replicate")
    assert (got["info"].world_size, got["info"].strategy) == (2, "zero3")
    assert got["step_count"] == SAVED_STEPS and got["lr"] == SAVED_LR
    assert rel_error(got["state"], want) <= TOLERANCE


def test_one_rank_replicate_to_two_ranks_zero3(pool, single_process, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    want = save_then_continue(path, "tied", "replicate")["state"]
    for got in pool.run(load_then_continue, path, "tied", "zero3"):
        assert (got["info"].world_size, got["step_count"]) == (1, SAVED_STEPS)
        assert rel_error(got["state"], want) <= TOLERANCE


@pytest.mark.parametrize("saved,loaded", [("zero1", "zero3"), ("zero3", "zero2"), ("zero2", "replicate")])
def test_strategy_change_on_two_ranks(pool, tmp_path: Path, saved: str, loaded: str) -> None:
    path = str(tmp_path / "ckpt")
    want = pool.run(save_then_continue, path, "mlp", saved)
    got = pool.run(load_then_continue, path, "mlp", loaded)
    for rank in range(2):
        assert rel_error(got[rank]["state"], want[rank]["state"]) <= TOLERANCE
