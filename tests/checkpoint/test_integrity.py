"""A checkpoint loads only the files its own save wrote: a shard file copied or hard-linked from
another checkpoint of the same run, a JSON file from another save or edited by hand, is refused on
every rank with a :class:`CheckpointIntegrityError` naming the file, the engine unchanged; the
description a load returns is the verified one. Each test first shows that the damage is real
(the foreign file differs from the checkpoint's own)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from dspark.checkpoint import (
    CheckpointIntegrityError,
    read_checkpoint_info,
    read_extra,
    verify_checkpoint,
)
from dspark.checkpoint.manifest import MANIFEST_FILE
from dspark.cli.main import main
from tests.checkpoint.ranks import load_checksum, load_error_keeping_state, save_at_steps


@pytest.fixture(scope="module")
def run_checkpoints(pool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, float]]:
    """Two zero3 checkpoints of one 2-rank run: ``a`` after 3 steps, ``b`` after 5."""
    root = tmp_path_factory.mktemp("run")
    sums = pool.run(save_at_steps, {3: str(root / "a"), 5: str(root / "b")})[0]
    return root / "a", root / "b", sums


@pytest.fixture
def a_and_b(run_checkpoints, tmp_path: Path) -> tuple[Path, Path]:
    a, b, _sums = run_checkpoints
    return Path(shutil.copytree(a, tmp_path / "a")), Path(shutil.copytree(b, tmp_path / "b"))


def _refused(pool, ckpt: Path, file_name: str, *words: str) -> list[str]:
    messages = []
    for rank, (kind, message, unchanged) in enumerate(pool.run(load_error_keeping_state, str(ckpt),
                                                               "mlp", "zero3", timeout=120)):
        assert kind == "CheckpointIntegrityError", (rank, kind, message)
        assert str(ckpt / file_name) in message, (rank, message)
        assert all(w in message for w in words), (rank, message)
        assert unchanged, f"rank {rank}: the refused load changed the engine"
        messages.append(message)
    return messages


def test_both_checkpoints_load_as_saved(pool, run_checkpoints) -> None:
    a, b, sums = run_checkpoints
    assert pool.run(load_checksum, str(a)) == [(3, pytest.approx(sums[3]))] * 2
    assert pool.run(load_checksum, str(b)) == [(5, pytest.approx(sums[5]))] * 2
    assert sums[3] != pytest.approx(sums[5])


@pytest.mark.parametrize("file_name", ["__0_0.distcp", "__1_0.distcp"])
@pytest.mark.parametrize("how", ["copy", "hard link"])
def test_a_shard_file_from_another_checkpoint_is_refused(pool, a_and_b, file_name: str, how: str) -> None:
    a, b = a_and_b
    assert (a / file_name).read_bytes() != (b / file_name).read_bytes()
    assert (a / file_name).stat().st_size == (b / file_name).stat().st_size   # same model, same layout
    (a / file_name).unlink()
    if how == "copy":
        shutil.copyfile(b / file_name, a / file_name)
    else:
        os.link(b / file_name, a / file_name)
    _refused(pool, a, file_name, "from another checkpoint")


def test_a_shard_file_with_equal_weights_from_another_save_is_refused(pool, tmp_path: Path) -> None:
    # two saves at the same step hold the same weights: only the save id tells their files apart
    pool.run(save_at_steps, {2: str(tmp_path / "a")})
    pool.run(save_at_steps, {2: str(tmp_path / "b")})
    shutil.copyfile(tmp_path / "b" / "__1_0.distcp", tmp_path / "a" / "__1_0.distcp")
    _refused(pool, tmp_path / "a", "__1_0.distcp", "does not hold the id of save")


def test_a_byte_changed_in_a_shard_file_is_refused(pool, a_and_b) -> None:
    a, _b = a_and_b
    with open(a / "__0_0.distcp", "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    _refused(pool, a, "__0_0.distcp", "record at bytes")


def test_training_state_from_another_checkpoint_of_the_run_is_refused(pool, a_and_b) -> None:
    a, b = a_and_b
    assert json.loads((b / "training_state.json").read_text())["step_count"] == 5
    shutil.copyfile(b / "training_state.json", a / "training_state.json")
    _refused(pool, a, "training_state.json", "written by another save")


@pytest.mark.parametrize(("field", "value"), [("step_count", 99), ("world_size", 4),
                                              ("strategy", "replicate"), ("precision", "fp16")])
def test_an_edited_dspark_json_is_refused_and_never_reported(pool, a_and_b, field: str, value) -> None:
    a, _b = a_and_b
    raw = json.loads((a / "dspark.json").read_text())
    raw[field] = value
    (a / "dspark.json").write_text(json.dumps(raw))
    _refused(pool, a, "dspark.json", "its content differs")
    with pytest.raises(CheckpointIntegrityError, match=r"dspark\.json"):
        read_checkpoint_info(a)   # what dspark ckpt info reads


def test_dspark_json_from_another_checkpoint_is_refused(pool, a_and_b) -> None:
    a, b = a_and_b
    shutil.copyfile(b / "dspark.json", a / "dspark.json")
    _refused(pool, a, "dspark.json", "written by another save")


def test_metadata_from_another_checkpoint_is_refused(pool, a_and_b) -> None:
    a, b = a_and_b
    shutil.copyfile(b / ".metadata", a / ".metadata")
    _refused(pool, a, ".metadata", "not this checkpoint's")


def test_a_removed_manifest_is_refused(pool, a_and_b) -> None:
    a, _b = a_and_b
    (a / MANIFEST_FILE).unlink()
    _refused(pool, a, "", f"has no {MANIFEST_FILE}")


def test_the_description_a_load_returns_is_the_manifests(run_checkpoints) -> None:
    a, _b, _sums = run_checkpoints
    info = read_checkpoint_info(a)
    manifest = json.loads((a / MANIFEST_FILE).read_text())
    assert info.save_id == manifest["save_id"] and len(info.save_id) == 32
    assert (info.step_count, info.world_size, info.strategy) == (3, 2, "zero3")
    assert manifest["checkpoint"]["step_count"] == 3 and manifest["checkpoint"]["world_size"] == 2
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "dspark.json",
                                         "training_state.json"]


@pytest.mark.parametrize("declared", [2, 3])
def test_a_checkpoint_without_manifest_loads_only_with_verify_false(pool, a_and_b, caplog, capsys,
                                                                    declared: int) -> None:
    """What the files declare (``format_version: 2``, written before manifests) never turns the
    check off: the caller does, with ``verify=False``."""
    a, _b = a_and_b
    (a / MANIFEST_FILE).unlink()
    for name in ("dspark.json", "training_state.json"):
        raw = json.loads((a / name).read_text())
        raw.pop("save_id")
        if name == "dspark.json":
            raw["format_version"] = declared
        (a / name).write_text(json.dumps(raw))
    _refused(pool, a, "", f"has no {MANIFEST_FILE}", "verify=False")
    with pytest.raises(CheckpointIntegrityError, match="verify=False"):
        read_checkpoint_info(a)
    for command in (["ckpt", "info", str(a)], ["ckpt", "export", str(a), str(a.parent / "out.pt")]):
        assert main(command) != 0
        assert f"has no {MANIFEST_FILE}" in capsys.readouterr().err
    for wrong in (None, 0, "False"):   # only False itself says so
        with pytest.raises(TypeError, match="True or False"):
            read_checkpoint_info(a, verify=wrong)
        with pytest.raises(TypeError, match=repr(wrong)):
            read_extra(a, "x", verify=wrong)
    with caplog.at_level(logging.WARNING, logger="dspark.checkpoint.info"):
        assert read_checkpoint_info(a, verify=False).step_count == 3
    assert "NOT verified" in caplog.text
    assert [step for step, _sum in pool.run(load_checksum, str(a), verify=False)] == [3, 3]
    assert main(["ckpt", "info", str(a), "--no-verify"]) == 0
    assert main(["ckpt", "export", str(a), str(a.parent / "out.pt"), "--no-verify"]) == 0
    assert not verify_checkpoint(a).ok


def test_ckpt_verify_passes_a_checkpoint_as_saved(run_checkpoints, capsys) -> None:
    a, _b, _sums = run_checkpoints
    assert main(["ckpt", "verify", str(a)]) == 0
    out = capsys.readouterr().out
    manifest = json.loads((a / MANIFEST_FILE).read_text())
    assert out.startswith("ok: ") and manifest["save_id"] in out and "5 files" in out
    assert main(["ckpt", "verify", str(a), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["checkpoint"]["step_count"] == 3 and report["problems"] == []
    assert report["bytes_checked"] == sum(f.stat().st_size for f in a.iterdir() if f.name != MANIFEST_FILE)


@pytest.mark.parametrize("damage", ["shard from b", "edited json", "byte flipped", "stray file"])
def test_ckpt_verify_names_each_file_that_is_not_the_saves(a_and_b, capsys, damage: str) -> None:
    a, b = a_and_b
    if damage == "shard from b":
        shutil.copyfile(b / "__1_0.distcp", a / "__1_0.distcp")
        bad = "__1_0.distcp"
    elif damage == "edited json":
        raw = json.loads((a / "training_state.json").read_text())
        raw["step_count"] = 99
        (a / "training_state.json").write_text(json.dumps(raw))
        bad = "training_state.json"
    elif damage == "byte flipped":
        data = bytearray((a / "__0_0.distcp").read_bytes())
        data[len(data) // 3] ^= 0x80
        (a / "__0_0.distcp").write_bytes(bytes(data))
        bad = "__0_0.distcp"
    else:
        (a / "notes.txt").write_text("mine")
        bad = "notes.txt"
    assert main(["ckpt", "verify", str(a)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAILED: ") and bad in lines[0], lines


def test_ckpt_verify_exit_codes_without_a_manifest_or_a_checkpoint(a_and_b, tmp_path: Path, capsys) -> None:
    a, _b = a_and_b
    (a / MANIFEST_FILE).unlink()
    assert main(["ckpt", "verify", str(a)]) == 1
    assert f"has no {MANIFEST_FILE}" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
