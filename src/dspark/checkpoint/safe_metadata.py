"""Reading DCP's ``.metadata`` without running code from it.

[Note: loading runs no code] DCP writes its index (``.metadata``) as a pickle, and its own reader
loads it with ``pickle.load``: a crafted file runs whatever it names. DSpark reads it with an
unpickler whose ``find_class`` resolves only the classes that DCP's file-system metadata is made of
(listed in ``_ALLOWED``), plus ``torch.Size`` and ``torch`` dtypes and layouts looked up by name;
anything else (``os.system``, ``builtins.eval``, ``subprocess.Popen``, any other class) is refused
before it is called. Every callable a pickle can reach goes through ``find_class`` (GLOBAL,
STACK_GLOBAL, INST, OBJ, EXT), and persistent ids are refused, so nothing outside the list runs.
The object read is then checked for shape: a :class:`Metadata` whose entries are tensors only (a
byte entry would be loaded by DCP with ``torch.load(weights_only=False)``) and whose storage
records name plain files inside the checkpoint directory (no ``..``, no sub-directories).

Tensor data (``*.distcp``) is read by DCP with ``torch.load(weights_only=True)``; DSpark's own files
are JSON. See :mod:`dspark.checkpoint.storage` for where these checks sit.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from dspark.checkpoint.plain_files import DCP_METADATA, read_plain_file
from dspark.errors import CheckpointError, first_line

__all__ = ["load_metadata", "validate_metadata"]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"

# (module, name) -> the object a pickle may reference. Classes here are plain dataclasses or enums
# whose construction sets attributes and nothing else (TensorProperties.__setstate__ maps an enum
# back to a memory format); paths are the pure kind, which never touch the file system.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_METADATA_MODULE, "Metadata"): dcp_metadata.Metadata,
    (_METADATA_MODULE, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (_METADATA_MODULE, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (_METADATA_MODULE, "TensorProperties"): dcp_metadata.TensorProperties,
    (_METADATA_MODULE, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (_METADATA_MODULE, "MetadataIndex"): dcp_metadata.MetadataIndex,
    (_METADATA_MODULE, "StorageMeta"): dcp_metadata.StorageMeta,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    (_FILESYSTEM_MODULE, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    # StorageMeta.checkpoint_id is the path the writer was given (a PosixPath on Linux)
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib._local", "PosixPath"): PurePosixPath,
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "PureWindowsPath"): PureWindowsPath,
    ("pathlib._local", "WindowsPath"): PureWindowsPath,
}

_LAYOUTS = {str(layout): layout for layout in (
    getattr(torch, name, None) for name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc",
                                            "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged"))
    if isinstance(layout, torch.layout)}


def _layout_by_name(name: object) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout`` (how a layout is pickled): a lookup, no
    attribute access on a name the file chose."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch.serialization" and name == "_get_layout":
            return _layout_by_name
        if module == "torch" and name.isidentifier():  # dtypes pickle as torch.<name>
            dtype = getattr(torch, name, None)
            if isinstance(dtype, torch.dtype):
                return dtype
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: it is not part of DCP's "
                                     "checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: DCP's metadata has none")


def load_metadata(path: Path, *, check: Callable[[bytes], None] | None = None) -> dcp_metadata.Metadata:
    """DCP's metadata read from the file at ``path`` with the restricted unpickler and checked by
    :func:`validate_metadata`; :class:`CheckpointError` naming the file for anything else.
    ``check`` sees the file's bytes before they are unpickled (the manifest's digest).

    Example::

        load_metadata(Path("ckpt/.metadata")).state_dict_metadata["model/w"].size   # torch.Size([7, 6])
    """
    try:
        raw = read_plain_file(path, DCP_METADATA)
    except OSError as exc:
        raise CheckpointError(f"{str(path)!r} cannot be read ({type(exc).__name__}: {exc})") from exc
    if check is not None:
        check(raw)
    try:
        loaded = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # any malformed pickle: refused, never retried with a laxer reader
        raise CheckpointError(
            f"{str(path)!r} is not DCP metadata DSpark can read safely ({type(exc).__name__}: "
            f"{first_line(exc)}); the checkpoint is damaged or was crafted, nothing in it was run"
        ) from exc
    validate_metadata(loaded, path)
    return loaded


def validate_metadata(metadata: object, path: Path) -> None:
    """Raise :class:`CheckpointError` naming ``path`` unless ``metadata`` is a :class:`Metadata`
    holding only tensor entries, whose storage records are plain files in the checkpoint
    directory with non-negative offsets and lengths.

    Example::

        validate_metadata(Metadata(state_dict_metadata={}), Path("ckpt/.metadata"))   # fine
    """
    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{str(path)!r} is refused: {why}")

    if type(metadata) is not dcp_metadata.Metadata:
        raise refuse(f"it holds {type(metadata).__name__}, not DCP metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise refuse("its state_dict_metadata is not a dict")
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise refuse(f"entry key {key!r} is not a string")
        if isinstance(entry, dcp_metadata.BytesStorageMetadata):
            raise refuse(f"entry {key!r} is a pickled object (BYTE_IO), which DCP would unpickle with "
                         "torch.load(weights_only=False); DSpark checkpoints hold tensors only")
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise refuse(f"entry {key!r} is a {type(entry).__name__}, not a tensor")
    records = metadata.storage_data
    if not isinstance(records, dict):
        raise refuse("its storage_data is not a dict")
    stored: dict[str, int] = {}
    for index, record in records.items():
        fqn = getattr(index, "fqn", None)
        if isinstance(fqn, str) and isinstance(getattr(record, "length", None), int):
            stored[fqn] = stored.get(fqn, 0) + record.length
    for key, entry in entries.items():
        assert isinstance(entry, dcp_metadata.TensorStorageMetadata)  # checked above
        why = _tensor_entry_problem(entry, stored.get(key, 0))
        if why is not None:
            raise refuse(f"entry {key!r} {why}")
    for index, record in records.items():
        if type(record) is not dcp_filesystem._StorageInfo:
            raise refuse(f"the storage record of {getattr(index, 'fqn', index)!r} is a "
                         f"{type(record).__name__}, not a file-system record")
        name = record.relative_path
        if not isinstance(name, str) or not _is_plain_file_name(name):
            raise refuse(f"a storage record points to {name!r}, outside the checkpoint directory")
        if not all(isinstance(v, int) and v >= 0 for v in (record.offset, record.length)):
            raise refuse(f"a storage record of {name!r} has offset={record.offset!r} "
                         f"length={record.length!r}")
        if record.transform_descriptors:
            raise refuse(f"a storage record of {name!r} asks for stream transforms "
                         f"{record.transform_descriptors!r}, which DSpark never writes")


def _tensor_entry_problem(entry: dcp_metadata.TensorStorageMetadata, stored_bytes: int) -> str | None:
    """Why a tensor entry cannot be loaded as it stands, or None. Its chunks must tile the tensor
    exactly (a part no chunk covers would keep whatever memory the destination held before, a
    part two chunks cover is ambiguous), and its storage records must hold at least its bytes (a
    declared size its files cannot hold would only make the load allocate it)."""
    size = entry.size
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return f"has dtype {dtype!r}, not a torch dtype"
    if not all(isinstance(d, int) and d >= 0 for d in size):
        return f"has size {tuple(size)!r}"
    numel = 1
    for d in size:
        numel *= d
    nbytes = numel * dtype.itemsize
    if stored_bytes < nbytes:
        return (f"declares {tuple(size)} {dtype} ({nbytes} bytes), but its storage records hold "
                f"{stored_bytes} bytes")
    boxes = []
    for chunk in entry.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or not all(
                isinstance(o, int) and isinstance(n, int) and o >= 0 and n >= 0 and o + n <= d
                for o, n, d in zip(offsets, sizes, size, strict=True)):
            return f"has a chunk at {offsets} of {sizes}, outside its size {tuple(size)}"
        boxes.append((offsets, sizes))
    covered = 0
    for _, sizes in boxes:
        volume = 1
        for n in sizes:
            volume *= n
        covered += volume
    if covered != numel or _overlap(boxes):
        return (f"has chunks that do not tile its size {tuple(size)} ({covered} of {numel} elements"
                f"{', some twice' if covered >= numel else ''}): part of it would be loaded from "
                "nowhere")
    return None


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two of the boxes share an element. Sorted by their first offset, a box can only
    meet the ones that start before it ends along dim 0 (DSpark's shards are rows: one each)."""
    if len(boxes) < 2 or not boxes[0][0]:
        return len(boxes) > 1   # 0-d: one chunk only
    ordered = sorted((b for b in boxes if all(n > 0 for n in b[1])), key=lambda b: b[0][0])
    for i, (offsets, sizes) in enumerate(ordered):
        for other_offsets, other_sizes in ordered[i + 1:]:
            if other_offsets[0] >= offsets[0] + sizes[0]:
                break
            if all(o2 < o1 + n1 and o1 < o2 + n2 for o1, n1, o2, n2
                   in zip(offsets, sizes, other_offsets, other_sizes, strict=True)):
                return True
    return False


def _is_plain_file_name(name: str) -> bool:
    return (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name)

