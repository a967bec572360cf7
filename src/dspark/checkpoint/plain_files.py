"""A checkpoint's files are its own: regular files, no symbolic links, of a bounded size.

A checkpoint downloaded from elsewhere is a directory someone else wrote. Where a file DSpark reads
is a symbolic link, it could point anywhere the process can read (another user's data, which a
load would put into the weights, or ``/dev/zero``, which would be read until memory runs out);
where it is a FIFO, reading it blocks forever. Every file a load opens goes through
:func:`check_plain_file` first. The checkpoint directory itself may be a link (``latest ->
step-100`` is a common layout); what it holds may not.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dspark.checkpoint.errors import CheckpointError

__all__ = ["MAX_JSON_BYTES", "check_plain_file", "read_plain_file"]

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
    """The bytes of ``path`` after :func:`check_plain_file`, refused above ``limit`` bytes.

    Example::

        json.loads(read_plain_file(Path("ckpt/dspark.json")))
    """
    size = check_plain_file(path).st_size
    if size > limit:
        raise CheckpointError(f"{str(path)!r} has {size} bytes, more than the {limit} a checkpoint's "
                              "JSON file may have: the checkpoint is damaged or was crafted")
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{str(path)!r} grew past {limit} bytes while it was read")
    return data
