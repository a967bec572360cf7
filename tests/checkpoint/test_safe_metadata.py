"""DCP's ``.metadata`` read with the restricted unpickler (no process group): what DCP writes loads,
anything that names another callable is refused before it is called."""

from __future__ import annotations

import pickle
import pickletools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dspark.checkpoint import CheckpointError
from dspark.checkpoint.safe_metadata import load_metadata


@pytest.fixture
def written(tmp_path: Path) -> Path:
    state = {"w": torch.ones(3, 2), "step": torch.tensor(3, dtype=torch.int64),
             "h": torch.zeros(2, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "ck"), no_dist=True)
    return tmp_path / "ck" / ".metadata"


def test_what_dcp_writes_reads_back_equal(written: Path) -> None:
    with open(written, "rb") as f:
        plain = pickle.load(f)  # the trusted reference: DCP's own reader does exactly this
    safe = load_metadata(written)
    assert safe.state_dict_metadata == plain.state_dict_metadata
    assert safe.storage_data == plain.storage_data


def _globals_of(blob: bytes) -> list[str]:
    ops = list(pickletools.genops(blob))
    return [str(arg) for op, arg, _ in ops if op.name in ("GLOBAL", "INST")]


@pytest.mark.parametrize("blob,refused", [
    (b"cos\nsystem\n(S'true'\ntR.", "os.system"),
    (b"cbuiltins\neval\n(S'1'\ntR.", "builtins.eval"),
    (b"ctorch\nload\n(S'x'\ntR.", "torch.load"),  # a torch attribute that is not a dtype
    (b"ctorch.distributed.checkpoint.metadata\nMetadata.__init__\n.", "Metadata.__init__"),
    (b"ctorch.serialization\nload\n.", "torch.serialization.load"),
])
def test_any_other_callable_is_refused_before_it_runs(tmp_path: Path, blob: bytes, refused: str) -> None:
    assert _globals_of(blob)  # each blob really names a callable
    path = tmp_path / ".metadata"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=r"refused to load .*" + refused.split(".")[-1]) as info:
        load_metadata(path)
    assert str(path) in str(info.value)


def test_a_layout_is_looked_up_not_fetched(tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(b"ctorch.serialization\n_get_layout\n(S'__import__'\ntR.")
    with pytest.raises(CheckpointError, match="unknown torch layout"):
        load_metadata(path)
