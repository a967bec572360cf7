"""The one place that calls PyTorch's distributed checkpoint (DCP): its file-system writer and
reader write and read the shard files and ``.metadata``; DSpark never writes a storage format.

With a process group DCP plans collectively (rank 0 coordinates, replicated tensors are written once)
and each rank writes its own file; the world-size-1 stand-in has no group, so DCP runs with
``no_dist``. DCP's warning that it runs without a group is expected there and silenced.

DSpark's state dict is flat already (see [Note: checkpoint layout]) and holds no ShardedTensor, so
DCP's planners run without flattening: a value such as the list of param groups is stored as one
object under its key instead of one entry per list item, and a loaded value lands in the caller's
dict (with ShardedTensor flattening on, DCP would put it in a copy).
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from dspark.checkpoint.errors import CheckpointError, CheckpointSaveError

__all__ = ["METADATA_FILE", "Metadata", "check_files", "read_metadata", "read_state", "write_state"]

METADATA_FILE = ".metadata"
"""DCP's index of every tensor, its chunks and where they are stored (written last by DCP)."""

_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized.*"


def write_state(state: dict[str, Any], directory: Path, *, distributed: bool) -> None:
    """Write ``state`` (tensors, DTensors, picklable values) into ``directory`` through DCP; every
    rank of the group calls it. ``sync_files`` makes the data durable before the caller publishes.

    Example::

        write_state({"model/w": torch.ones(3)}, Path("/tmp/ck.tmp"), distributed=False)
    """
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=not distributed)
    except CheckpointException as exc:  # a BaseException: turned into an Exception callers can catch
        raise CheckpointSaveError(f"DCP could not write {str(directory)!r}: {_describe(exc)}",
                                  failed_ranks=tuple(sorted(exc.failures))) from exc


def read_state(state: dict[str, Any], directory: Path, *, distributed: bool) -> None:
    """Fill ``state``'s tensors in place from ``directory`` (DCP reads, for each DTensor, only the
    rows this rank holds); non-tensor entries are replaced by the stored values.

    Example::

        state = {"model/w": torch.empty(3)}
        read_state(state, Path("/tmp/ck"), distributed=False)
    """
    reader = dcp.FileSystemReader(directory)
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not distributed)
    except CheckpointException as exc:
        raise CheckpointError(f"DCP could not read {str(directory)!r}: {_describe(exc)}") from exc


def read_metadata(directory: Path) -> Metadata:
    """DCP's metadata of the checkpoint in ``directory``; :class:`CheckpointError` when it is
    missing or unreadable (a save that never finished, or a damaged file).

    Example::

        sorted(read_metadata(Path("/tmp/ck")).state_dict_metadata)   # ['model/w', ...]
    """
    path = directory / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{str(directory)!r} has no {METADATA_FILE} file: it is not a complete "
                              "checkpoint (a save that did not finish, or files removed)")
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"{str(path)!r} cannot be read ({type(exc).__name__}: {exc}): the "
                              "checkpoint is damaged") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{str(path)!r} holds {type(metadata).__name__}, not DCP metadata")
    return metadata


def check_files(directory: Path, metadata: Metadata) -> None:
    """Raise :class:`CheckpointError` unless every file DCP's metadata points to is there and long
    enough: a lost or truncated shard file is reported by name before any rank starts reading.

    Example::

        check_files(Path("/tmp/ck"), read_metadata(Path("/tmp/ck")))
    """
    needed: dict[str, int] = {}
    for info in dict(metadata.storage_data or {}).values():
        # DCP's file-system storage records (relative_path, offset, length) per stored item.
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[relative] = max(needed.get(relative, 0), end)
    for relative, end_bytes in sorted(needed.items()):
        path = directory / relative
        if not path.is_file():
            raise CheckpointError(f"{str(directory)!r} is a partial checkpoint: shard file {relative!r} "
                                  f"is missing ({len(needed)} file(s) expected)")
        size_bytes = path.stat().st_size
        if size_bytes < end_bytes:
            raise CheckpointError(f"{str(directory)!r} is damaged: shard file {relative!r} has "
                                  f"{size_bytes} bytes, its index needs {end_bytes}")


def _describe(exc: CheckpointException) -> str:
    """DCP's per-rank failures in one line each (its own message is a set of full tracebacks)."""
    return "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                     for rank, (error, _trace) in sorted(exc.failures.items()))
