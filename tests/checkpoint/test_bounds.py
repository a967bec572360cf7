"""Every file DSpark reads from a checkpoint or a model directory has a bound, refused before the
parse and named with its size and the bound (see [Note: bounds on what is read] in
dspark.checkpoint.plain_files), and the manifest is parsed once per process ([Note: the manifest is
parsed once] in dspark.checkpoint.manifest)."""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.checkpoint import CheckpointError, manifest, read_checkpoint_info, verify_checkpoint
from dspark.checkpoint.export import export_checkpoint
from dspark.checkpoint.hf_files import SafetensorsSource
from dspark.checkpoint.plain_files import (
    DSPARK_JSON,
    HF_INDEX,
    MANIFEST,
    SAFETENSORS_HEADER,
    TRAINING_STATE,
)
from dspark.cli.main import main
from tests.engine import tiny_models as tm
from tests.messages import assert_names

SGD = functools.partial(torch.optim.SGD, lr=0.1)


@pytest.fixture
def saved(single_process: Any, tmp_path: Path) -> Path:
    """A one-rank checkpoint this test may damage."""
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD)
    x, y = tm.batch("mlp", 8, 0)
    engine.backward(tm.loss_fn("mlp", engine(x), y))
    engine.step()
    engine.save(tmp_path / "ckpt")
    engine.close()
    return tmp_path / "ckpt"


def _sparse(path: Path, size_bytes: int) -> None:
    """``path`` replaced by a file of ``size_bytes`` that takes no room on disk."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as out:
        out.truncate(size_bytes)


@pytest.mark.parametrize(("name", "bound"), [("manifest.json", MANIFEST), ("dspark.json", DSPARK_JSON),
                                             ("training_state.json", TRAINING_STATE)])
def test_a_file_over_its_bound_is_refused_unread_naming_its_size_and_the_bound(
        saved: Path, name: str, bound: Any) -> None:
    size_bytes = 200 * 2**20  # the manifest of the report: over every one of these bounds
    assert bound.max_bytes < size_bytes
    _sparse(saved / name, size_bytes)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as refused:
        dspark.checkpoint.read_extra(saved, "anything")  # reads all three
    assert time.monotonic() - started < 1.0
    assert_names(str(refused.value), name, f"{size_bytes} bytes", f"the {bound.max_bytes}")


def test_a_manifest_of_millions_of_empty_objects_is_refused_before_its_parse(saved: Path) -> None:
    # well under the byte bound, but a parse would build every object
    crafted = b'{"format": "dspark-manifest", "unknown": [' + b"{}," * 6_000_000 + b"{}]}"
    (saved / "manifest.json").write_bytes(crafted)
    started = time.monotonic()
    report = verify_checkpoint(saved)
    assert time.monotonic() - started < 1.0
    assert len(report.problems) == 1, report.problems
    assert_names(report.problems[0], "manifest.json", "JSON values", f"the {MANIFEST.max_values}")


def test_a_manifest_listing_too_many_files_is_refused(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "MAX_MANIFEST_FILES", 3)
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint_info(saved)
    assert_names(str(refused.value), "manifest.json", "lists 4 files", "the 3")


def test_verify_prints_a_bounded_number_of_lines(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = json.loads((saved / "manifest.json").read_text())
    entry = {"bytes": 0, raw["hash"]: "0" * 64, "chunks": [[0, 0, "0" * 64]]}
    raw["files"].update({f"missing-{i}.distcp": entry for i in range(30)})
    (saved / "manifest.json").write_text(json.dumps(raw))
    assert main(["ckpt", "verify", str(saved)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 21 and all(line.startswith("FAILED: ") for line in lines), lines
    assert_names(lines[-1], "and 10 more", "30 in all", "--json")


def test_the_manifest_is_parsed_once_per_load(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parses = []
    parse = manifest._parse
    monkeypatch.setattr(manifest, "_parse", lambda *a, **k: parses.append(1) or parse(*a, **k))
    manifest._parsed.clear()
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD)
    engine.load(saved)
    engine.close()
    export_checkpoint(saved, saved.parent / "out", max_shard_size=64)  # a shard per tensor
    assert len(parses) == 1


def test_a_changed_manifest_is_parsed_again(saved: Path) -> None:
    first = manifest.read_manifest(saved)
    raw = json.loads((saved / "manifest.json").read_text())
    raw["checkpoint"]["step_count"] += 1  # same length, same second: a new parse all the same
    (saved / "manifest.json").write_text(json.dumps(raw, indent=2) + "\n")
    again = manifest.read_manifest(saved)
    assert first is not None and again is not None and again is not first
    assert again.summary["step_count"] == first.summary["step_count"] + 1


def test_a_safetensors_index_or_header_over_its_bound_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 3)}, str(tmp_path / "model.safetensors"))
    assert SafetensorsSource(tmp_path).read("w", 1, 2).tolist() == [[1.0, 1.0, 1.0]]
    _sparse(tmp_path / "model.safetensors.index.json", HF_INDEX.max_bytes + 1)
    with pytest.raises(CheckpointError) as refused:
        SafetensorsSource(tmp_path)
    assert_names(str(refused.value), "model.safetensors.index.json", f"{HF_INDEX.max_bytes + 1} bytes",
                 f"the {HF_INDEX.max_bytes}")
    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError) as refused:
        SafetensorsSource(crafted)
    assert_names(str(refused.value), "crafted.safetensors", f"header of {2**40} bytes",
                 f"the {SAFETENSORS_HEADER.max_bytes}")


def test_a_safetensors_header_is_parsed_once_and_read_by_rows(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import save_file

    tensors = {f"t{i}": torch.arange(12.0).reshape(4, 3) + i for i in range(5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loads = []
    real = json.loads
    monkeypatch.setattr(json, "loads", lambda *a, **k: loads.append(1) or real(*a, **k))
    source = SafetensorsSource(tmp_path)
    for name, value in tensors.items():
        assert torch.equal(source.read(name), value)
        assert torch.equal(source.read(name, 1, 3), value[1:3])
        assert torch.equal(source.read(name, 3, 9), value[3:])
    assert len(loads) == 1
    os.truncate(tmp_path / "model.safetensors", 100)  # cut short: the header says more
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        SafetensorsSource(tmp_path)
