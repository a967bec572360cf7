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
from pathlib import Path
from typing import Any

from dspark.checkpoint.errors import CheckpointError

__all__ = ["MAX_JSON_BYTES", "check_plain_file", "read_plain_file", "write_json"]

MAX_JSON_BYTES = 256 * 2**20
"""The largest JSON file of a checkpoint a load reads (DSpark's own are kilobytes to a few MB)."""


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


def read_plain_file(path: Path, *, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path`` if it is a regular file, not a link, of at most ``limit`` bytes;
    :class:`CheckpointError` naming it otherwise. It is opened without following a link and without
    blocking, then checked: a file swapped after a check could not slip past it.

    Example::

        json.loads(read_plain_file(Path("ckpt/dspark.json")))
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
        if status.st_size > limit:
            raise CheckpointError(f"{str(path)!r} has {status.st_size} bytes, more than the {limit} a "
                                  "checkpoint's JSON file may have: the checkpoint is damaged or was "
                                  "crafted")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{str(path)!r} grew past {limit} bytes while it was read")
    return data


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
