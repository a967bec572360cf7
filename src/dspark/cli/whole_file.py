"""Files the command line writes (``--json``, ``--plot``): whole or not at all.

A write that fails half-way (a full disk, a file size limit) used to leave a truncated file where a
later step would read it as the command's output. The text goes into a hidden sibling first, renamed
over the path once it is all written; a failure removes the sibling and is an ``OSError`` naming the
path, which the command prints as one line.

Example::

    write_whole(Path("plan.json"), plan.to_json() + "\\n")
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["write_whole"]


def write_whole(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes: a plot) at ``path``, all of it or nothing (see the module docstring)."""
    staging = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(staging, "wb") as out:
            out.write(text if isinstance(text, bytes) else text.encode("utf-8"))
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, path)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise OSError(exc.errno, f"cannot write {str(path)!r}: {exc.strerror or exc}; nothing was "
                                 "left there") from exc
