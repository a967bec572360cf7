"""Atomic publication of checkpoint directories, on the file system alone."""

from __future__ import annotations

from pathlib import Path

from dspark.checkpoint.atomic import publish, remove_stale, staging_dir


def _dir(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "data").write_text(content)
    return path


def test_staging_is_a_hidden_sibling(tmp_path: Path) -> None:
    assert staging_dir(tmp_path / "ck", "t1") == tmp_path / ".ck.tmp-t1"


def test_publish_moves_into_place_and_replaces_the_old_one(tmp_path: Path) -> None:
    final = tmp_path / "ck"
    publish(_dir(staging_dir(final, "a"), "first"), final, "a")
    assert (final / "data").read_text() == "first"
    publish(_dir(staging_dir(final, "b"), "second"), final, "b")
    assert (final / "data").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_remove_stale_clears_unfinished_saves_but_keeps_a_stranded_old_copy(tmp_path: Path) -> None:
    final = tmp_path / "ck"
    _dir(staging_dir(final, "dead"), "partial")
    _dir(tmp_path / ".ck.old-x", "the only copy")  # a crash between publish's two renames
    _dir(tmp_path / ".other.tmp-y", "another checkpoint's")
    assert remove_stale(final) == [tmp_path / ".ck.tmp-dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.old-x", ".other.tmp-y"]
    _dir(final, "new")
    assert remove_stale(final) == [tmp_path / ".ck.old-x"]  # once ck exists the old copy can go
