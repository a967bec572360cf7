"""The one place that calls PyTorch's distributed checkpoint (DCP): its file-system writer and
reader write and read the shard files and ``.metadata``; DSpark never writes a storage format.

With a process group DCP plans collectively (rank 0 coordinates, replicated tensors are written once)
and each rank writes its own file; the world-size-1 stand-in has no group, so DCP runs with
``no_dist``. DCP's warning that it runs without a group is expected there and silenced.

DSpark's state dict is flat already (see [Note: checkpoint layout]) and holds tensors only, so DCP's
planners run without flattening. Reading never runs code from the checkpoint ([Note: loading runs no
code] in :mod:`dspark.checkpoint.safe_metadata`). DSpark overrides three pieces of DCP's reader side:

* ``FileSystemReader.read_metadata``: the restricted unpickler instead of ``pickle.load``, and the
  metadata DSpark already read and checked is handed back instead of reading the file twice;
* ``FileSystemReader.read_data``: called once per file, so that an error names the file, and a byte
  (pickled-object) read item is refused before DCP would ``torch.load(weights_only=False)`` it;
* ``DefaultLoadPlanner.load_bytes``: refuses, as a second lock on the same door.

Tensor records are read by DCP itself with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.futures import Future

from dspark.checkpoint.manifest import check_bytes, read_manifest
from dspark.checkpoint.plain_files import check_plain_file
from dspark.checkpoint.safe_metadata import load_metadata
from dspark.checkpoint.verify import RecordCheck
from dspark.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointSaveError,
    first_line,
)

__all__ = ["METADATA_FILE", "Metadata", "check_files", "read_metadata", "read_state", "stage_on_cpu",
           "write_state"]

METADATA_FILE = ".metadata"
"""DCP's index of every tensor, its chunks and where they are stored (written last by DCP)."""

_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized.*"


def write_state(state: Mapping[str, Any], directory: Path, *, distributed: bool,
                process_group: Any = None) -> None:
    """Write ``state`` (tensors and DTensors only) into ``directory`` through DCP; every rank of the
    group calls it. ``sync_files`` makes every file durable before the caller publishes.
    ``process_group``: the torch process group DCP coordinates over (None: the default group).

    Example::

        write_state({"model/w": torch.ones(3)}, Path("/tmp/ck.tmp"), distributed=False)
    """
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):  # DCP would pickle it: a door into every load
            raise AssertionError(f"checkpoint entry {key!r} is a {type(value).__name__}; the DCP "
                                 "state holds tensors only (other values go to JSON)")
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.save(dict(state), storage_writer=writer, planner=planner,
                     process_group=process_group, no_dist=not distributed)
    except CheckpointException as exc:  # a BaseException: turned into an Exception callers can catch
        raise CheckpointSaveError(f"DCP could not write {str(directory)!r}: {_describe(exc)}",
                                  failed_ranks=tuple(sorted(exc.failures))) from exc


def stage_on_cpu(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of ``state`` in CPU memory (DTensors stay DTensors, with copied local shards), so that
    training can change the originals while the copy is written.

    Example::

        staged = stage_on_cpu(tensors)   # what engine.save(path, async_save=True) writes
    """
    return {key: _copy_to_cpu(value) for key, value in state.items()}


def empty_like(value: Any) -> Any:
    """An empty tensor laid out like ``value``: a DTensor's local rows on its own mesh and placements
    (1-D, or hybrid sharding's 2-D mesh), or a whole tensor.

    Example::

        fresh = empty_like(engine.sharded_state_dict()["model"]["fc.weight"])   # what DCP fills
    """
    if not isinstance(value, DTensor):
        return torch.empty_like(value)
    return DTensor.from_local(torch.empty_like(value.to_local()), value.device_mesh, value.placements,
                              run_check=False, shape=value.shape, stride=value.stride())


def _copy_to_cpu(value: torch.Tensor) -> torch.Tensor:
    # DCP's own stager deep-copies a CPU DTensor's whole storage (a zero1/2 shard is a view of the
    # full parameter) and fails on an empty shard; this copies the local rows and nothing else.
    if not isinstance(value, DTensor):
        return value.detach().to("cpu", copy=True)
    local = value.to_local().detach()
    if local.device.type != "cpu":
        return value.detach().to("cpu")  # a CPU DTensor holding a copy, as DCP stages GPU DTensors
    return DTensor.from_local(local.clone(), value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def read_state(state: dict[str, Any], directory: Path, metadata: Metadata, *,
               distributed: bool) -> None:
    """Fill ``state``'s tensors in place from ``directory`` (DCP reads, for each DTensor, only the
    rows this rank holds). ``metadata`` is what :func:`read_metadata` returned for ``directory``.

    Example::

        state = {"model/w": torch.empty(3)}
        read_state(state, Path("/tmp/ck"), read_metadata(Path("/tmp/ck")), distributed=False)
    """
    reader = _SafeFileSystemReader(directory, metadata)
    planner = _TensorOnlyLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not distributed)
    except CheckpointException as exc:
        # every rank learns every rank's failure: a file found foreign on one rank is refused on all
        foreign = [(rank, error) for rank, (error, _trace) in sorted(exc.failures.items())
                   if isinstance(error, CheckpointIntegrityError)]
        if foreign:
            rank, error = foreign[0]
            raise CheckpointIntegrityError(f"rank {rank}: {error}") from exc
        raise CheckpointError(f"DCP could not read {str(directory)!r}: {_describe(exc)}") from exc


def read_metadata(directory: Path) -> Metadata:
    """DCP's metadata of the checkpoint in ``directory``, read without running code; raises
    :class:`CheckpointError` when it is missing, unreadable, crafted, or holds anything but tensors.

    Example::

        sorted(read_metadata(Path("/tmp/ck")).state_dict_metadata)   # ['model/w', ...]
    """
    path = directory / METADATA_FILE
    if path.is_symlink():
        check_plain_file(path)   # refused, naming the link
    if not path.is_file():
        raise CheckpointError(f"{str(directory)!r} has no {METADATA_FILE} file: it is not a complete "
                              "checkpoint (a save that did not finish, or files removed)")
    manifest = read_manifest(directory)
    if manifest is None:
        return load_metadata(path)   # no manifest: read_checkpoint_info refused it unless verify=False
    return load_metadata(path, check=lambda data: check_bytes(manifest, METADATA_FILE, data))


def check_files(directory: Path, metadata: Metadata) -> None:
    """Raise :class:`CheckpointError` unless every file DCP's metadata points to is there and long
    enough: a lost or truncated shard file is reported by name before any rank starts reading.

    Example::

        check_files(Path("/tmp/ck"), read_metadata(Path("/tmp/ck")))
    """
    needed: dict[str, int] = {}
    for info in dict(metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)  # checked to be a _StorageInfo by read_metadata
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for relative, end_bytes in sorted(needed.items()):
        path = directory / relative
        if not path.is_file() and not path.is_symlink():
            raise CheckpointError(f"{str(directory)!r} is a partial checkpoint: shard file {relative!r} "
                                  f"is missing ({len(needed)} file(s) expected)")
        size_bytes = check_plain_file(path).st_size
        if size_bytes < end_bytes:
            raise CheckpointError(f"{str(directory)!r} is damaged: shard file {relative!r} has "
                                  f"{size_bytes} bytes, its index needs {end_bytes}")


class _SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader with the metadata already read safely, and errors named by file."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(directory)
        self._directory = directory
        self._metadata = metadata
        manifest = read_manifest(directory)
        self._check = None if manifest is None else RecordCheck(manifest)

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        # DCP reads every record through here: with a manifest, the record is hashed beside the
        # read (see [Note: checkpoint integrity])
        if self._check is not None:
            self._check.record(sinfo.relative_path, int(sinfo.offset), int(sinfo.length))
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank files, which DSpark never writes
            raise CheckpointError(f"{str(self._directory)!r} has no per-rank metadata")
        if self._metadata.storage_meta is not None:
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            path = self._directory / name
            refused = [i.dest_index.fqn for i in items if i.type == LoadItemType.BYTE_IO]
            if refused:
                raise CheckpointError(f"{str(path)!r} holds pickled object(s) {refused[:3]!r}, which "
                                      "DSpark refuses to load (its checkpoints hold tensors only)")
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                if self._check is not None:
                    self._check.close()
                raise
            except Exception as exc:  # a crafted or damaged record: weights_only refused it, or junk
                if self._check is not None:
                    self._check.finish()   # a record changed since the save: say so, by file
                raise CheckpointError(
                    f"{str(path)!r} holds a record that is not a plain tensor ({type(exc).__name__}: "
                    f"{_why_refused(exc)}); the file is damaged or was crafted, nothing in it was run"
                ) from exc
        if self._check is not None:
            if self._check.records_read != len(plan.items):   # a PyTorch that reads past _slice_file
                raise AssertionError(f"{self._check.records_read} of {len(plan.items)} records read from "
                                     f"{str(self._directory)!r} were checked against its manifest")
            self._check.finish()
        done: Future[None] = Future()
        done.set_result(None)
        return done


class _TensorOnlyLoadPlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, "
                              "which DSpark refuses to load")



def _why_refused(exc: BaseException) -> str:
    """The line of torch.load's refusal that says what was refused; its first line suggests
    ``weights_only=False``, exactly what must not be done with a crafted file."""
    if isinstance(exc, pickle.UnpicklingError):
        for line in str(exc).splitlines():
            if "GLOBAL" in line or "Unsupported" in line or "WeightsUnpickler" in line:
                return line.strip()[:300]
    return first_line(exc)


def _describe(exc: CheckpointException) -> str:
    """DCP's per-rank failures in one line each (its own message is a set of full tracebacks)."""
    return "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                     for rank, (error, _trace) in sorted(exc.failures.items()))
