"""Save, continue one step; a fresh engine loads and takes the same step: the parameters agree, which
proves that parameters, optimizer state (restored before the fresh engine's first step),
hyper-parameters and the step count all came back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint.ranks import (
    SAVED_LOSS_SCALE,
    SAVED_LR,
    SAVED_STEPS,
    load_then_continue,
    save_then_continue,
)
from tests.engine.harness import rel_error


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), (key, float((got[key] - want[key]).abs().max()))


@pytest.mark.parametrize("model", ["mlp", "tied"])
def test_two_rank_round_trip_resumes_exactly(pool, tmp_path: Path, strategy: str, model: str) -> None:
    # mlp: uneven rows and a 0-d parameter (rank 1 holds none of it); tied: a tied weight and a
    # parameter that never gets a gradient (so it has no optimizer state)
    path = str(tmp_path / "ckpt")
    want = pool.run(save_then_continue, path, model, strategy)
    got = pool.run(load_then_continue, path, model, strategy)
    for rank in range(2):
        assert got[rank]["step_count"] == SAVED_STEPS
        assert got[rank]["lr"] == SAVED_LR
        assert got[rank]["optimizer_bytes"] > 0
        _assert_identical(got[rank]["state"], want[rank]["state"])
    shard_files = sorted(p.name for p in Path(path).glob("*.distcp"))
    assert len(shard_files) == 2, shard_files  # every rank wrote its own file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporaries left


def test_fp16_loss_scale_comes_back(pool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    want = pool.run(save_then_continue, path, "tied", "zero2", precision="fp16")
    got = pool.run(load_then_continue, path, "tied", "zero2", precision="fp16")
    for rank in range(2):
        assert got[rank]["loss_scale"] == SAVED_LOSS_SCALE
        _assert_identical(got[rank]["state"], want[rank]["state"])


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_single_process_round_trip(single_process, tmp_path: Path, strategy: str) -> None:
    """World size 1 without a process group: DCP runs without one."""
    path = str(tmp_path / "ckpt")
    want = save_then_continue(path, "tied", strategy)
    got = load_then_continue(path, "tied", strategy)
    assert got["step_count"] == SAVED_STEPS and got["info"].world_size == 1
    _assert_identical(got["state"], want["state"])
    assert rel_error(got["state"], want["state"]) == 0.0
