"""The hash behind a checkpoint's manifest: saves write BLAKE3 digests, checkpoints saved before
with sha256 digests still verify and load, and a manifest naming a hash this DSpark does not know
is refused by name. ``data/sha256_manifest`` was saved by DSpark before BLAKE3 (a Linear(4, 3) with
AdamW after one step, world size 1), and is kept as it was written."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

import blake3
import pytest
import torch

import dspark
from dspark.checkpoint import CheckpointIntegrityError, digest, verify_checkpoint
from dspark.checkpoint.manifest import MANIFEST_FILE, read_manifest
from tests.checkpoint.forge import reseal
from tests.messages import assert_names

OLD = Path(__file__).parent / "data" / "sha256_manifest"
OLD_SUMS = {"weight": -0.22839441895484924, "bias": -0.9848253726959229}
"""The sums of the saved parameters, as the run that saved them printed them."""


def _engine() -> dspark.Engine:
    torch.manual_seed(1)   # not the saved weights: a load must bring those
    return dspark.Engine(torch.nn.Linear(4, 3), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                         strategy="replicate")


def _load_sums(path: Path) -> dict[str, float]:
    engine = _engine()
    try:
        engine.load(path)
        return {name: value.sum().item() for name, value in engine.module.state_dict().items()}
    finally:
        engine.close()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def old(tmp_path: Path) -> Path:
    return Path(shutil.copytree(OLD, tmp_path / "old"))


def test_chunk_digests_are_blake3_and_sha256_of_the_bytes() -> None:
    data = bytes(range(256)) * 100
    assert digest.HASH_NAME == "blake3"
    assert digest.chunk_digest(data) == blake3.blake3(data).hexdigest()
    assert digest.chunk_digest(data, "sha256") == hashlib.sha256(data).hexdigest()
    big = bytes(digest.PIECE_BYTES + 7)   # two pieces: the hash of the pieces' digests
    pieces = blake3.blake3(big[:digest.PIECE_BYTES]).digest() + blake3.blake3(big[digest.PIECE_BYTES:]).digest()
    assert digest.chunk_digest(big) == blake3.blake3(pieces).hexdigest()


def test_an_unknown_hash_name_is_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(ValueError) as error:
        digest.check_hash_name("md5")
    assert_names(str(error.value), "'md5'", "'blake3'", "'sha256'")


def test_a_checkpoint_saved_with_sha256_digests_still_verifies_and_loads(single_process, old: Path) -> None:
    assert json.loads((old / MANIFEST_FILE).read_text())["hash"] == "sha256"
    report = verify_checkpoint(old)
    assert report.ok, report.problems
    assert report.files == 4 and read_manifest(old).hash_name == "sha256"
    assert _load_sums(old) == pytest.approx(OLD_SUMS)


def test_a_byte_changed_under_a_sha256_manifest_is_refused(single_process, old: Path) -> None:
    _flip_a_byte(old / "__0_0.distcp")
    assert_names(" ".join(verify_checkpoint(old).problems), "__0_0.distcp")
    with pytest.raises(CheckpointIntegrityError) as error:
        _load_sums(old)
    assert_names(str(error.value), str(old / "__0_0.distcp"))


def test_a_save_writes_blake3_digests_and_a_changed_byte_is_refused(single_process, tmp_path: Path) -> None:
    engine = _engine()
    engine.save(tmp_path / "new")
    engine.close()
    raw = json.loads((tmp_path / "new" / MANIFEST_FILE).read_text())
    assert raw["hash"] == "blake3" and all("blake3" in item and "sha256" not in item for item in raw["files"].values())
    assert verify_checkpoint(tmp_path / "new").ok
    _flip_a_byte(tmp_path / "new" / "__0_0.distcp")
    assert_names(" ".join(verify_checkpoint(tmp_path / "new").problems), "__0_0.distcp", "differ")
    with pytest.raises(CheckpointIntegrityError) as error:
        _load_sums(tmp_path / "new")
    assert_names(str(error.value), str(tmp_path / "new" / "__0_0.distcp"))


def test_a_resealed_blake3_manifest_catches_an_edited_json_byte(single_process, old: Path) -> None:
    reseal(old)   # the sha256 checkpoint's files under a fresh BLAKE3 manifest
    assert read_manifest(old).hash_name == "blake3" and verify_checkpoint(old).ok
    assert _load_sums(old) == pytest.approx(OLD_SUMS)
    raw = (old / "training_state.json").read_bytes().replace(b'"step_count": 1', b'"step_count": 2')
    (old / "training_state.json").write_bytes(raw)
    with pytest.raises(CheckpointIntegrityError) as error:
        _load_sums(old)
    assert_names(str(error.value), str(old / "training_state.json"))


@pytest.mark.parametrize("name", ["md5", "BLAKE3", None])
def test_a_manifest_naming_an_unknown_hash_is_refused_by_name(single_process, old: Path, name) -> None:
    raw = json.loads((old / MANIFEST_FILE).read_text())
    raw["hash"] = name
    (old / MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(CheckpointIntegrityError) as error:
        read_manifest(old)
    assert_names(str(error.value), str(old / MANIFEST_FILE), repr(name), "'blake3'", "'sha256'")
    assert_names(" ".join(verify_checkpoint(old).problems), repr(name))
    with pytest.raises(CheckpointIntegrityError) as error:
        _load_sums(old)
    assert_names(str(error.value), repr(name))
