"""``dspark.json``: written for humans, read back to recognise a checkpoint (no process group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    is_checkpoint,
    read_checkpoint_info,
)
from dspark.checkpoint.info import write_info
from tests.checkpoint.forge import reseal


def _info(**overrides: object) -> CheckpointInfo:
    fields: dict[str, object] = dict(step_count=7, strategy="zero3", precision="bf16", world_size=2,
                                     optimizer="AdamW", num_param_groups=1, num_params=91,
                                     params={"w": [7, 6]}, dspark_version="0.1.0", torch_version="2.13")
    return CheckpointInfo(**{**fields, **overrides})  # type: ignore[arg-type]


def test_round_trip_and_readable_json(tmp_path: Path) -> None:
    write_info(tmp_path, _info(save_id="ab" * 16))
    reseal(tmp_path)   # a save writes the manifest last
    assert is_checkpoint(tmp_path) and not is_checkpoint(tmp_path / "nothing")
    assert read_checkpoint_info(tmp_path) == _info(save_id="ab" * 16)
    raw = json.loads((tmp_path / "dspark.json").read_text())
    assert raw["format"] == "dspark-checkpoint" and raw["strategy"] == "zero3" and raw["params"]["w"] == [7, 6]


def test_a_stranded_old_copy_is_pointed_to(tmp_path: Path) -> None:
    (tmp_path / ".ck.old-abc").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"left at '.ck.old-abc'"):
        read_checkpoint_info(tmp_path / "ck")


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ck").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="it is a file"):
        read_checkpoint_info(tmp_path / "ck")


@pytest.mark.parametrize("payload,message", [
    ({"format": "other"}, "is not a DSpark checkpoint description"),
    ({"format": "dspark-checkpoint", "step_count": 1}, "unexpected fields"),
    ({"format": "dspark-checkpoint", "bogus": 1}, "unexpected fields"),
])
def test_foreign_or_damaged_descriptions_are_refused(tmp_path: Path, payload: dict[str, object],
                                                      message: str) -> None:
    (tmp_path / "dspark.json").write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint_info(tmp_path)


def test_an_unknown_format_version_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"format_version=99.*valid: 2"):
        _info(format_version=99)


def test_a_format_1_checkpoint_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"format_version=1.*pickles"):
        _info(format_version=1)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("world_size", "two", "world_size='two' must be an int >= 1"),
    ("step_count", -5, "step_count=-5 must be an int >= 0"),
    ("num_param_groups", True, "num_param_groups=True must be an int >= 1"),
    ("optimizer", 3, "optimizer=3 must be a string"),
    ("params", {"w": [7, "6"]}, "must map names to lists of sizes"),
])
def test_fields_of_the_wrong_type_are_refused_naming_the_file(tmp_path: Path, field: str, value: object,
                                                               message: str) -> None:
    """A hand-edited or crafted dspark.json: read back as it stood, info and the engine disagreed."""
    write_info(tmp_path, _info())
    raw = json.loads((tmp_path / "dspark.json").read_text())
    raw[field] = value
    (tmp_path / "dspark.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message) as info:
        read_checkpoint_info(tmp_path)
    assert "dspark.json" in str(info.value)
