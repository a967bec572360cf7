"""Loading a checkpoint never runs code from it: a crafted payload in any of its files (DCP's
``.metadata``, every shard file, DSpark's JSON files) is refused on every rank with a
:class:`CheckpointError` naming the file, and the payload's command never runs.

Every payload would create a marker file if it ran; each test first proves that its payload is
live (plain ``pickle`` / ``torch.load(weights_only=False)`` does create the marker), then that a
2-rank load refuses it and the marker does not exist.

The attacker controls every file, ``manifest.json`` included: each test rewrites the manifest to
match the crafted files (:func:`tests.checkpoint.forge.reseal`), so that what is tested is the
check below the manifest, which must hold on its own."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.checkpoint import CheckpointError, storage
from tests.checkpoint.forge import reseal
from tests.checkpoint.ranks import load_error_keeping_state
from tests.messages import assert_names


class _Payload:
    """Unpickling this runs ``touch MARKER``: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _pickle_payload(marker: Path) -> bytes:
    blob = pickle.dumps(_Payload(marker))
    pickle.loads(blob)  # the control: a plain unpickler runs it
    assert marker.exists(), "the payload is not live: the test could not fail"
    marker.unlink()
    return blob


def _torch_payload(marker: Path, pad_bytes: int = 0) -> bytes:
    """A torch.save file whose unpickling runs the payload; ``pad_bytes`` of tensor data beside it
    make it as long as the records it stands in for (shorter ones are refused from the index)."""
    out = io.BytesIO()
    torch.save((torch.zeros(pad_bytes, dtype=torch.uint8), _Payload(marker)) if pad_bytes else _Payload(marker),
               out)
    torch.load(io.BytesIO(out.getvalue()), weights_only=False)  # the control
    assert marker.exists(), "the payload is not live: the test could not fail"
    marker.unlink()
    return out.getvalue()


def _refused_everywhere(pool, ckpt: Path, file_name: str, marker: Path, why: str = "") -> None:
    results = pool.run(load_error_keeping_state, str(ckpt), "mlp", "zero3", timeout=120)
    for rank, (kind, message, unchanged) in enumerate(results):
        assert kind == "CheckpointError", (rank, kind, message)
        assert str(ckpt / file_name) in message and why in message, (rank, message)
        assert unchanged, f"rank {rank}: the failed load changed the engine"
    assert not marker.exists(), "the payload ran"


@pytest.mark.parametrize("file_name", [".metadata", "dspark.json", "training_state.json"])
def test_a_pickle_in_place_of_a_file_is_refused_and_never_runs(pool, copy: Path, tmp_path: Path,
                                                               file_name: str) -> None:
    marker = tmp_path / "ran"
    (copy / file_name).write_bytes(_pickle_payload(marker))
    reseal(copy)
    _refused_everywhere(pool, copy, file_name, marker)


@pytest.mark.parametrize("file_name", ["__0_0.distcp", "__1_0.distcp"])
def test_a_crafted_record_in_a_shard_file_is_refused_and_never_runs(pool, copy: Path, tmp_path: Path,
                                                                    file_name: str) -> None:
    # The attacker controls every file: the shard file holds the payload and the index (written
    # with only DCP's own classes, so it passes the metadata check) points every record of that
    # file at it. Loading reaches torch.load of the payload, where weights_only refuses it.
    marker = tmp_path / "ran"
    metadata = storage.read_metadata(copy)
    longest = max(r.length for r in metadata.storage_data.values() if r.relative_path == file_name)
    blob = _torch_payload(marker, pad_bytes=longest)
    (copy / file_name).write_bytes(blob)
    for record in metadata.storage_data.values():
        if record.relative_path == file_name:
            record.offset, record.length = 0, len(blob)
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(copy)
    _refused_everywhere(pool, copy, file_name, marker, why="GLOBAL posix.system")


def test_a_pickled_entry_in_the_index_is_refused(pool, copy: Path, tmp_path: Path) -> None:
    # What an older DSpark (or plain DCP with a non-tensor value) writes: a BYTE_IO entry, which
    # DCP's planner would read with torch.load(weights_only=False).
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = storage.read_metadata(copy)
    metadata.state_dict_metadata["optim_groups"] = BytesStorageMetadata()
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(copy)
    for kind, message, unchanged in pool.run(load_error_keeping_state, str(copy), "mlp", "zero3"):
        assert kind == "CheckpointError" and unchanged
        assert_names(message, ".metadata", "'optim_groups'", "BYTE_IO")


def test_a_checkpoint_holds_tensors_and_json_only(two_rank_checkpoint: Path) -> None:
    saved = two_rank_checkpoint
    metadata = storage.read_metadata(saved)
    assert metadata.state_dict_metadata and all(
        type(entry).__name__ == "TensorStorageMetadata" for entry in metadata.state_dict_metadata.values())
    names = sorted(p.name for p in saved.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "dspark.json", "manifest.json",
                     "training_state.json"]


def test_an_index_pointing_outside_the_checkpoint_is_refused(single_process, copy: Path) -> None:
    metadata = storage.read_metadata(copy)
    next(iter(metadata.storage_data.values())).relative_path = "../../etc/passwd"
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(copy)
    with pytest.raises(CheckpointError) as caught:
        storage.read_metadata(copy)
    assert_names(str(caught.value), "'../../etc/passwd'")


def _sharded_model_entry(metadata: Any) -> str:
    """A model tensor both ranks wrote rows of (a 1-row one has an empty chunk from rank 1)."""
    return next(k for k, v in metadata.state_dict_metadata.items()
                if k.startswith("model/") and len(v.chunks) == 2 and all(min(c.sizes) > 0 for c in v.chunks))


@pytest.mark.parametrize("damage", ["a chunk missing", "no chunk", "a chunk twice"])
def test_chunks_that_do_not_tile_a_tensor_are_refused(pool, copy: Path, damage: str) -> None:
    """A part of a tensor no chunk covers kept whatever memory its destination held before: the
    load succeeded with heap contents in the weights."""
    metadata = storage.read_metadata(copy)
    key = _sharded_model_entry(metadata)
    chunks = metadata.state_dict_metadata[key].chunks
    damaged = {"a chunk missing": chunks[:-1], "no chunk": [], "a chunk twice": [*chunks, chunks[0]]}
    metadata.state_dict_metadata[key] = dataclasses.replace(metadata.state_dict_metadata[key],
                                                            chunks=damaged[damage])
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(copy)
    for kind, message, unchanged in pool.run(load_error_keeping_state, str(copy), "mlp", "zero3"):
        assert kind == "CheckpointError" and unchanged, (kind, message)
        assert ".metadata" in message and "do not tile" in message, message


def test_a_size_its_records_cannot_hold_is_refused(pool, copy: Path) -> None:
    metadata = storage.read_metadata(copy)
    entry = metadata.state_dict_metadata["rng/rank0/torch"]
    huge = torch.Size([2**45])
    metadata.state_dict_metadata["rng/rank0/torch"] = dataclasses.replace(
        entry, size=huge, chunks=[dataclasses.replace(entry.chunks[0], sizes=huge)])
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(copy)
    for kind, message, unchanged in pool.run(load_error_keeping_state, str(copy), "mlp", "zero3"):
        assert kind == "CheckpointError" and unchanged, (kind, message)
        assert "its storage records hold" in message, message


@pytest.mark.parametrize("file_name", ["training_state.json", "dspark.json", ".metadata", "__1_0.distcp"])
def test_a_symbolic_link_in_the_checkpoint_is_refused(pool, copy: Path, tmp_path: Path, file_name: str) -> None:
    """A link could read any file the process can (another user's, into the weights)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (copy / file_name).rename(outside / file_name)
    (copy / file_name).symlink_to(outside / file_name)
    for kind, message, unchanged in pool.run(load_error_keeping_state, str(copy), "mlp", "zero3"):
        assert kind == "CheckpointError" and unchanged, (kind, message)
        assert file_name in message and "symbolic link" in message, message


def test_a_fifo_in_place_of_the_training_state_is_refused_at_once(pool, copy: Path) -> None:
    (copy / "training_state.json").unlink()
    os.mkfifo(copy / "training_state.json")   # reading it would block forever
    for kind, message, unchanged in pool.run(load_error_keeping_state, str(copy), "mlp", "zero3"):
        assert kind == "CheckpointError" and unchanged, (kind, message)
        assert "not a regular file" in message, message


def test_one_ranks_damaged_random_state_fails_every_rank_before_anything_changes(pool, copy: Path) -> None:
    """Rank 1's own entries were read after the ranks agreed: rank 1 raised half-way (weights
    already loaded), rank 0 returned normally, and the job parted."""
    state = json.loads((copy / "training_state.json").read_text())
    rank1 = state["rng"]["1"]["__dict__"]   # JSON-encoded dict (see checkpoint.json_values)
    rank1["python"][1] = rank1["python"][1][:10]   # the wrong length
    (copy / "training_state.json").write_text(json.dumps(state))
    reseal(copy)
    for kind, message, unchanged in pool.run(load_error_keeping_state, str(copy), "mlp", "zero3"):
        assert kind == "CheckpointError" and unchanged, (kind, message)
        assert "rank(s) [1]" in message or ("rank 1's" in message and "Python/NumPy" in message), message


def _load_with_another_loader(path: str) -> tuple[str, bool, dict[str, Any]]:
    """A resumed run that builds its loader with another global batch size than the saved one."""
    from tests.checkpoint.ranks import make_engine, snapshot

    engine = make_engine("mlp", "zero3")
    loader = dspark.DataLoader(torch.utils.data.TensorDataset(torch.arange(64.0)), global_batch_size=8)
    saved = {"loader": loader}
    engine.save(path, extra=saved)
    next(iter(loader))
    before_loader = loader.state_dict()
    other = dspark.DataLoader(torch.utils.data.TensorDataset(torch.arange(64.0)), global_batch_size=4)
    sched_model = torch.nn.Linear(1, 1)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(sched_model.parameters(), lr=1.0), 1)
    engine.save(path, extra={"loader": loader, "sched": sched})
    sched.step()
    sched_before = sched.state_dict()
    before = snapshot(engine)
    try:
        engine.load(path, extra={"sched": sched, "loader": other})
    except Exception as exc:
        after = snapshot(engine)
        same = all(torch.equal(before[k], after[k]) for k in before)
        return f"{type(exc).__name__}: {exc}", same, {"sched": sched.state_dict() == sched_before,
                                                       "loader": loader.state_dict() == before_loader}
    finally:
        engine.close()
    return "no error", False, {}


def test_an_extra_that_refuses_its_state_leaves_the_engine_and_the_others_as_they_were(pool, tmp_path: Path) -> None:
    """The engine's weights and step count were replaced before the loader refused its state."""
    for message, unchanged, extras in pool.run(_load_with_another_loader, str(tmp_path / "ck")):
        assert message.startswith("CheckpointError") and "extra['loader']" in message, message
        assert unchanged, "the engine changed"
        assert extras == {"sched": True, "loader": True}, extras
