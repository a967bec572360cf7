"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.checkpoint.ranks import save_then_continue


@pytest.fixture(scope="module")
def two_rank_checkpoint(pool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zero3 checkpoint written by 2 ranks (two shard files); tests damage copies of it."""
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    pool.run(save_then_continue, str(path), "mlp", "zero3")
    return path


@pytest.fixture
def copy(two_rank_checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of :func:`two_rank_checkpoint` this test may change."""
    return Path(shutil.copytree(two_rank_checkpoint, tmp_path / "ckpt"))
