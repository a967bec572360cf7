"""Atomic publication of a checkpoint directory.

[Note: atomic save] Every rank writes into a hidden sibling ``.<name>.tmp-<token>`` (same parent, so
the same file system and a rename, not a copy). Only when every rank has finished and agreed does
rank 0 publish it: an old checkpoint is first renamed aside to ``.<name>.old-<token>``, the new one
renamed to ``<name>``, then the old one deleted. A crash before publication leaves ``<name>`` as it
was (the stale temporary is removed by the next save); a crash between the two renames leaves no
``<name>`` but the complete old checkpoint beside it, which the load error points to. POSIX cannot
swap two non-empty directories in one rename, so that window of two renames is the minimum.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

__all__ = ["publish", "remove_stale", "staging_dir"]

log = logging.getLogger(__name__)


def staging_dir(final: Path, token: str) -> Path:
    """The hidden sibling every rank writes into before ``final`` is published.

    Example::

        staging_dir(Path("/ck/step10"), "ab12")   # Path('/ck/.step10.tmp-ab12')
    """
    return final.with_name(f".{final.name}.tmp-{token}")


def _aside_dir(final: Path, token: str) -> Path:
    return final.with_name(f".{final.name}.old-{token}")


def remove_stale(final: Path) -> list[Path]:
    """Delete temporaries of earlier saves to ``final`` that never finished; returns them.
    Set-aside old checkpoints are kept while ``final`` is missing (they may be the only copy).

    Example::

        remove_stale(Path("/ck/step10"))   # [Path('/ck/.step10.tmp-9f3c')] after a crash
    """
    removed = []
    patterns = [f".{final.name}.tmp-*"]
    if final.exists():
        patterns.append(f".{final.name}.old-*")
    for pattern in patterns:
        for stale in sorted(final.parent.glob(pattern)):
            log.warning("removing %s, left by a checkpoint save that did not finish", stale)
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def publish(staging: Path, final: Path, token: str) -> None:
    """Move the complete checkpoint ``staging`` to ``final``, replacing what is there.

    Example::

        publish(Path("/ck/.step10.tmp-ab12"), Path("/ck/step10"), "ab12")
    """
    aside = None
    if final.exists():
        aside = _aside_dir(final, token)
        os.rename(final, aside)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside)


def _fsync_dir(directory: Path) -> None:
    # Make the renames durable: a directory's entries live in the directory itself.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms (Windows) cannot open a directory; the rename still happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
