"""Atomic publication of checkpoint directories and the stale-staging rule, on the file system alone."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dspark.checkpoint import atomic
from dspark.checkpoint.atomic import (
    OWNER_FILE,
    STALE_AFTER_S,
    claim,
    publish,
    remove_stale,
    staging_dir,
)


def _dir(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "data").write_text(content)
    return path


def _owned(path: Path, *, pid: int, started_at: float | None, host: str | None = None) -> Path:
    _dir(path, "partial")
    (path / OWNER_FILE).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid,
                                               "started_at": started_at}))
    return path


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for p in (path, *path.iterdir()):
        os.utime(p, (then, then))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_staging_is_a_hidden_sibling(tmp_path: Path) -> None:
    assert staging_dir(tmp_path / "ck", "t1") == tmp_path / ".ck.tmp-t1"


def test_publish_moves_into_place_and_replaces_the_old_one(tmp_path: Path) -> None:
    final = tmp_path / "ck"
    claim(staging_dir(final, "a"))
    (staging_dir(final, "a") / "data").write_text("first")
    publish(staging_dir(final, "a"), final, "a")
    assert sorted(p.name for p in final.iterdir()) == ["data"]  # the owner file is not published
    publish(_dir(staging_dir(final, "b"), "second"), final, "b")
    assert (final / "data").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_publish_fsyncs_the_staging_directory_then_the_parent(tmp_path: Path, monkeypatch) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(atomic, "sync_dir", synced.append)
    final = tmp_path / "ck"
    publish(_dir(staging_dir(final, "a"), "x"), final, "a")
    assert synced == [staging_dir(final, "a"), tmp_path]


def test_a_failed_removal_of_the_old_copy_is_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    final = _dir(tmp_path / "ck", "old")

    def refuse(path: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied (simulated)", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, logger="dspark.checkpoint.atomic"):
        publish(_dir(staging_dir(final, "b"), "new"), final, "b")
    assert (final / "data").read_text() == "new"
    assert "could not be removed" in caplog.text and "Permission denied (simulated)" in caplog.text
    assert (tmp_path / ".ck.old-b" / "data").read_text() == "old"


def test_when_the_new_copy_cannot_be_put_in_place_the_old_one_comes_back(tmp_path: Path, monkeypatch) -> None:
    final = _dir(tmp_path / "ck", "old")
    staging = _dir(staging_dir(final, "b"), "new")
    real_rename = os.rename

    def rename(src: object, dst: object) -> None:
        if Path(str(src)) == staging:
            raise OSError(18, "Invalid cross-device link (simulated)")
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="cross-device"):
        publish(staging, final, "b")
    assert (final / "data").read_text() == "old"
    assert not (tmp_path / ".ck.old-b").exists()


def test_stale_staging_of_a_dead_owner_is_removed_a_live_one_is_kept(tmp_path: Path) -> None:
    final = tmp_path / "ck"
    started_at = psutil.Process().create_time()
    live = _owned(staging_dir(final, "live"), pid=os.getpid(), started_at=started_at)
    dead = _owned(staging_dir(final, "dead"), pid=_dead_pid(), started_at=None)
    reused = _owned(staging_dir(final, "reused"), pid=os.getpid(), started_at=started_at + 1)
    _age(live, 10 * STALE_AFTER_S)  # a live owner's directory is kept however old
    assert remove_stale(final) == [dead, reused]
    assert live.is_dir()


def test_without_a_visible_owner_age_decides(tmp_path: Path) -> None:
    final = tmp_path / "ck"
    elsewhere_new = _owned(staging_dir(final, "a"), pid=1, started_at=1.0, host="another-host")
    elsewhere_old = _owned(staging_dir(final, "b"), pid=1, started_at=1.0, host="another-host")
    no_owner_new = _dir(staging_dir(final, "c"), "partial")
    no_owner_old = _dir(staging_dir(final, "d"), "partial")
    for path in (elsewhere_old, no_owner_old):
        _age(path, STALE_AFTER_S + 60)
    assert remove_stale(final) == [elsewhere_old, no_owner_old]
    assert elsewhere_new.is_dir() and no_owner_new.is_dir()


def test_a_stranded_old_copy_is_kept_until_the_checkpoint_exists_again(tmp_path: Path) -> None:
    final = tmp_path / "ck"
    _dir(tmp_path / ".ck.old-x", "the only copy")  # a crash between publish's two renames
    _dir(tmp_path / ".other.tmp-y", "another checkpoint's")
    assert remove_stale(final) == []
    _dir(final, "new")
    assert remove_stale(final) == [tmp_path / ".ck.old-x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-y", "ck"]


def test_saving_over_a_symlinked_path_leaves_no_link_behind(tmp_path: Path) -> None:
    # latest -> step-1: the new checkpoint replaces the link, the link's target stays as it was,
    # and the link set aside while the new one was put in place is gone (not left dangling)
    target = _dir(tmp_path / "step-1", "step 1")
    final = tmp_path / "latest"
    final.symlink_to(target, target_is_directory=True)
    claim(staging_dir(final, "a"))
    (staging_dir(final, "a") / "data").write_text("new")
    publish(staging_dir(final, "a"), final, "a")
    assert not final.is_symlink() and (final / "data").read_text() == "new"
    assert (target / "data").read_text() == "step 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]


def test_a_dangling_symlinked_path_is_replaced(tmp_path: Path) -> None:
    final = tmp_path / "latest"
    final.symlink_to(tmp_path / "removed", target_is_directory=True)
    claim(staging_dir(final, "a"))
    publish(staging_dir(final, "a"), final, "a")
    assert final.is_dir() and not final.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_set_aside_link_left_by_an_earlier_save_is_removed(tmp_path: Path) -> None:
    # what earlier DSpark left behind: the link renamed aside, then shutil.rmtree refused it
    final = _dir(tmp_path / "latest", "new")
    aside = tmp_path / ".latest.old-x1"
    aside.symlink_to(tmp_path / "step-1-deleted", target_is_directory=True)
    assert remove_stale(final) == [aside]
    assert not aside.is_symlink()
