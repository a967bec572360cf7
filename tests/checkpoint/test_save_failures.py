"""A save that fails on one rank, while preparing, writing or publishing, fails the same way on every
rank (no rank hangs), leaves the old checkpoint as it was and no staging directory behind. A save
never removes another live save's staging directory; a failed removal of the old copy after the new
one is in place is only a warning."""

from __future__ import annotations

import json
import os
import shutil
import socket
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import psutil
import pytest

import dspark
from dspark.checkpoint import read_checkpoint_info
from dspark.checkpoint.atomic import OWNER_FILE
from tests.checkpoint.ranks import load_then_continue, make_engine, train
from tests.messages import assert_names


def _fault(fault: str) -> ExitStack:
    """Patches that make this rank fail the way ``fault`` says."""
    stack = ExitStack()
    if fault == "cannot_write":  # this rank may not write into the staging directory
        def refuse(staging: Path) -> None:
            raise PermissionError(13, "Permission denied (simulated)", str(staging))
        stack.enter_context(mock.patch("dspark.checkpoint.save._check_can_write", refuse))
    elif fault == "json_disk_full":
        def full(*args: object) -> None:
            raise OSError(28, "No space left on device (simulated)")
        stack.enter_context(mock.patch("dspark.checkpoint.save.write_info", full))
    elif fault in ("publish_fails", "old_copy_stuck"):
        real_rename, real_rmtree = os.rename, shutil.rmtree

        def rename(src: object, dst: object) -> None:
            if fault == "publish_fails" and Path(str(src)).name.startswith(".ckpt.tmp-"):
                raise OSError(13, "Permission denied (simulated)")
            real_rename(src, dst)  # type: ignore[arg-type]

        def rmtree(path: object, *args: object, **kwargs: object) -> None:
            if fault == "old_copy_stuck" and ".old-" in str(path):
                raise OSError(16, "Device or resource busy (simulated)")
            real_rmtree(path, *args, **kwargs)  # type: ignore[arg-type]
        stack.enter_context(mock.patch("os.rename", rename))
        stack.enter_context(mock.patch("shutil.rmtree", rmtree))
    return stack


def save_with_fault(path: str, fault: str, faulty_rank: int) -> tuple[str, str]:
    """Train one step and save at ``path`` with ``fault`` on ``faulty_rank``; returns ("ok", "") or
    (error type, message) of what this rank raised."""
    engine = make_engine("mlp", "zero2")
    train(engine, "mlp", range(1))
    try:
        with _fault(fault) if dspark.get_world().rank == faulty_rank else ExitStack():
            engine.save(path)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        engine.close()
    return "ok", ""


def _contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()}


@pytest.mark.parametrize("fault,rank,message", [
    ("cannot_write", 1, "failed on rank(s) [1]: PermissionError: [Errno 13] Permission denied (simulated)"),
    ("json_disk_full", 0, "failed on rank(s) [0]: OSError: [Errno 28] No space left on device (simulated)"),
    ("publish_fails", 0, "could not be put in place on rank 0: PermissionError: [Errno 13] Permission denied"),
])
def test_one_rank_failing_fails_every_rank_and_keeps_the_old_checkpoint(
        pool, single_process, copy: Path, fault: str, rank: int, message: str) -> None:
    before = _contents(copy)
    for kind, text in pool.run(save_with_fault, str(copy), fault, rank, timeout=120):
        assert kind == "CheckpointSaveError" and message in text, text
    assert _contents(copy) == before
    assert sorted(p.name for p in copy.parent.iterdir()) == ["ckpt"]  # no staging dir left
    assert load_then_continue(str(copy), "mlp", "replicate")["step_count"] == 2


def test_a_stuck_old_copy_is_a_warning_not_a_failed_save(pool, copy: Path) -> None:
    assert pool.run(save_with_fault, str(copy), "old_copy_stuck", 0) == [("ok", "")] * 2
    assert read_checkpoint_info(copy).step_count == 1  # the new checkpoint is in place
    assert [p.name for p in copy.parent.iterdir() if p.name.startswith(".ckpt.old-")]  # left over


def test_an_existing_file_in_the_way_is_the_same_error_on_every_rank(pool, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    for kind, text in pool.run(save_with_fault, str(tmp_path / "notes.txt"), "none", 0):
        assert kind == "ValueError"
        assert_names(text, "notes.txt")
    for kind, text in pool.run(save_with_fault, str(tmp_path / "notes.txt" / "ckpt"), "none", 0):
        assert kind == "CheckpointSaveError" and "failed on rank(s) [0]" in text
        assert "NotADirectoryError" in text or "FileExistsError" in text, text
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_live_concurrent_save_is_not_removed_as_stale(pool, copy: Path) -> None:
    started_at = psutil.Process().create_time()  # this test process plays the other job's rank 0
    live = copy.parent / ".ckpt.tmp-otherjob"
    live.mkdir()
    (live / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                               "started_at": started_at}))
    dead = copy.parent / ".ckpt.tmp-crashed"
    dead.mkdir()
    (dead / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                               "started_at": started_at - 1}))
    assert pool.run(save_with_fault, str(copy), "none", 0) == [("ok", "")] * 2
    assert live.is_dir() and not dead.exists()
