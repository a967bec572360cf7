"""A checkpoint's files are its own: regular files, no symbolic links, of a bounded size.

A checkpoint downloaded from elsewhere is a directory someone else wrote. Where a file DSpark reads
is a symbolic link, it could point anywhere the process can read (another user's data, which a
load would put into the weights, or ``/dev/zero``, which would be read until memory runs out);
where it is a FIFO, reading it blocks forever. Every file a load opens goes through
:func:`check_plain_file` first. The checkpoint directory itself may be a link (``latest ->
step-100`` is a common layout); what it holds may not. :func:`write_json` writes DSpark's own JSON
files, durably.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.errors import CheckpointError

__all__ = ["DCP_METADATA", "DSPARK_JSON", "HF_INDEX", "MANIFEST", "MODEL_CONFIG", "SAFETENSORS_HEADER",
           "TRAINING_STATE",
           "Bound", "check_plain_file", "check_values", "read_plain_file", "write_json"]


@dataclass(frozen=True, slots=True)
class Bound:
    """The most DSpark reads of one kind of file it did not necessarily write itself.

    [Note: bounds on what is read] A file from elsewhere (a checkpoint downloaded, a model directory)
    is read whole and parsed, so its size bounds the time and memory a read takes: a crafted
    ``manifest.json`` of tens of millions of empty objects took minutes and gigabytes to parse. Each
    kind of file has a bound in bytes, far above what DSpark writes (the sizes below say how
    far), checked from the file's status before a byte is read; a JSON file also has a bound in
    values, since a parse costs per value more than per byte (``{}`` is two bytes and an object):
    the values are counted (``,``, ``[`` and ``{``: a fast pass over the bytes, an upper bound on
    the values) before the parse. Over a bound, :class:`CheckpointError` names the file, its size
    and the bound. The table is in docs/checkpoints.md ("Bounds on what is read").
    """

    what: str
    """The kind of file, as an error names it."""
    max_bytes: int
    max_values: int | None = None
    """JSON values at most (None: not JSON)."""


DSPARK_JSON = Bound("a checkpoint's dspark.json", 2**20, 10_000)
"""A few kilobytes: the checkpoint's description and its parameters' names."""
TRAINING_STATE = Bound("a checkpoint's training_state.json", 128 * 2**20, 10_000_000)
"""About 300 bytes and 20 values per parameter tensor (its optimizer's non-tensor state), some
kilobytes per rank (its random states), and the ``extra`` entries."""
MODEL_CONFIG = Bound("a checkpoint's config.json (the model's HuggingFace config)", 16 * 2**20, 1_000_000)
"""A few kilobytes: the model's HuggingFace configuration, as ``from_pretrained`` reads it."""
MANIFEST = Bound("a checkpoint's manifest.json", 160 * 2**20, 5_000_000)
"""About 135 bytes and 4 values per chunk (one per record DCP wrote): a million chunks."""
DCP_METADATA = Bound("a checkpoint's DCP .metadata", 2**30)
"""About 250 bytes per record, pickled (read by a restricted unpickler)."""
HF_INDEX = Bound("a safetensors index (model.safetensors.index.json)", 64 * 2**20, 2_000_000)
"""One name and one file name per tensor."""
SAFETENSORS_HEADER = Bound("a safetensors file's header", 64 * 2**20, 4_000_000)
"""About 120 bytes and 6 values per tensor (the safetensors library has a bound of its own, lower)."""


def check_plain_file(path: Path) -> os.stat_result:
    """``path``'s status if it is a regular file and not a symbolic link; :class:`CheckpointError`
    naming it otherwise. ``FileNotFoundError`` when it does not exist.

    Example::

        check_plain_file(Path("ckpt/dspark.json")).st_size   # 412
    """
    status = os.lstat(path)
    if stat.S_ISLNK(status.st_mode):
        raise CheckpointError(f"{str(path)!r} is a symbolic link (to {os.readlink(path)!r}): a "
                              "checkpoint's files must be its own, a link could read any file; copy "
                              "the file itself into the checkpoint directory")
    if not stat.S_ISREG(status.st_mode):
        raise CheckpointError(f"{str(path)!r} is not a regular file (a FIFO, a device or a "
                              "directory): the checkpoint is damaged or was crafted")
    return status


def read_plain_file(path: Path, bound: Bound) -> bytes:
    """The bytes of ``path`` if it is a regular file, not a link, within ``bound``;
    :class:`CheckpointError` naming it otherwise. It is opened without following a link and without
    blocking, then checked: a file swapped after a check could not slip past it.

    Example::

        json.loads(read_plain_file(Path("ckpt/dspark.json"), DSPARK_JSON))
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        if os.path.islink(path):
            check_plain_file(path)   # raises, naming the link and its target
        raise
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise CheckpointError(f"{str(path)!r} is not a regular file (a FIFO, a device or a "
                                  "directory): the checkpoint is damaged or was crafted")
        _check_size(path, status.st_size, bound)
        data = handle.read(bound.max_bytes + 1)
    if len(data) > bound.max_bytes:
        raise CheckpointError(f"{str(path)!r} grew past {bound.max_bytes} bytes while it was read")
    check_values(path, data, bound)
    return data


def _check_size(path: Path, size_bytes: int, bound: Bound) -> None:
    if size_bytes > bound.max_bytes:
        raise CheckpointError(f"{str(path)!r} has {size_bytes} bytes, more than the {bound.max_bytes} "
                              f"DSpark reads of {bound.what} (see 'Bounds on what is read' in "
                              "docs/checkpoints.md): it is damaged or was crafted")


def check_values(path: Path, data: bytes, bound: Bound) -> None:
    """:class:`CheckpointError` naming ``path`` when JSON ``data`` may hold more values than
    ``bound`` allows (see [Note: bounds on what is read]); nothing for a bound without values.

    Example::

        check_values(Path("ckpt/manifest.json"), data, MANIFEST)
    """
    if bound.max_values is None:
        return
    values = data.count(b",") + data.count(b"[") + data.count(b"{") + 1
    if values > bound.max_values:
        raise CheckpointError(f"{str(path)!r} holds up to {values} JSON values in {len(data)} bytes, more "
                              f"than the {bound.max_values} DSpark reads of {bound.what} (see 'Bounds on "
                              "what is read' in docs/checkpoints.md): it is damaged or was crafted")


def write_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON at ``path`` and make it durable (fsync) before returning.

    Example::

        write_json(Path("/tmp/ck.tmp/dspark.json"), {"format": "dspark-checkpoint"})
    """
    with open(path, "w", encoding="utf-8") as out:
        json.dump(payload, out, indent=2, allow_nan=False)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())
