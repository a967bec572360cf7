"""Atomic publication of a checkpoint directory.

[Note: atomic save] Every rank writes into a hidden sibling ``.<name>.tmp-<token>`` (same parent, so
the same file system and a rename, not a copy). Only when every rank has finished and agreed does
rank 0 publish it: the staging directory is fsynced (its files were, as they were written), an old
checkpoint is renamed aside to ``.<name>.old-<token>``, the new one renamed to ``<name>``, the parent
directory fsynced, then the old one deleted (a failure to delete it is a warning: the new checkpoint
is in place). If the second rename fails the old checkpoint is renamed back. A crash before
publication leaves ``<name>`` as it was; a crash between the two renames leaves no ``<name>`` but the
complete old checkpoint beside it, which the load error points to. POSIX cannot swap two non-empty
directories in one rename, so that window of two renames is the minimum.

A path that is a symbolic link (``latest -> step-100``, or a link whose target is gone) is replaced
by the new checkpoint directory like an old checkpoint is; the link's target is left as it was.
What is set aside is then the link itself, and it is unlinked, never followed (``shutil.rmtree``
refuses a link: the link used to be left behind, dangling once its target was deleted).

[Note: stale staging directories] A save clears staging directories that earlier saves to the same
path left behind, but never one that a live save is writing (another job saving to the same path).
Each staging directory holds ``.dspark-owner.json`` naming the host, pid and process start time of
the rank 0 that created it (removed just before publication). A staging directory is stale when

* its owner ran on this host and that process is gone (pid and start time: a reused pid is not it),
* or nothing in it changed for :data:`STALE_AFTER_S` seconds (an owner on another host, whose
  processes this host cannot see, or no owner file at all).

A live save writes its files continuously, so an hour without a change means nobody is writing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import psutil

from dspark.checkpoint.plain_files import write_json

__all__ = ["OWNER_FILE", "STALE_AFTER_S", "claim", "publish", "remove_stale", "staging_dir",
           "stale_reason", "sync_dir"]

log = logging.getLogger(__name__)

OWNER_FILE = ".dspark-owner.json"
STALE_AFTER_S = 3600.0
"""A staging directory nobody wrote to for this long is stale, whoever owns it."""


def staging_dir(final: Path, token: str) -> Path:
    """The hidden sibling every rank writes into before ``final`` is published.

    Example::

        staging_dir(Path("/ck/step10"), "ab12")   # Path('/ck/.step10.tmp-ab12')
    """
    return final.with_name(f".{final.name}.tmp-{token}")


def _aside_dir(final: Path, token: str) -> Path:
    return final.with_name(f".{final.name}.old-{token}")


def claim(staging: Path) -> None:
    """Create ``staging`` with its owner file (this process, on this host): what tells a later save
    that this directory belongs to a save that is still running.

    Example::

        claim(staging_dir(Path("/ck/step10"), "ab12"))
    """
    staging.mkdir()
    write_json(staging / OWNER_FILE, {"host": socket.gethostname(), "pid": os.getpid(),
                                      "started_at": psutil.Process().create_time()})


def stale_reason(staging: Path, *, now: float | None = None) -> str | None:
    """Why ``staging`` is left over from a save that will never finish, or None while it may still
    be written (see [Note: stale staging directories]).

    Example::

        stale_reason(Path("/ck/.step10.tmp-9f3c"))   # 'its owner, pid 4121 on this host, is gone'
    """
    owner = _read_owner(staging)
    if owner is not None and owner.get("host") == socket.gethostname():
        pid, start = owner.get("pid"), owner.get("started_at")
        if isinstance(pid, int) and (start is None or isinstance(start, float)):
            if not _is_running(pid, start):
                return f"its owner, pid {pid} on this host, is gone"
            return None  # a live save on this host, however slow
    idle_s = (time.time() if now is None else now) - _last_change(staging)
    if idle_s > STALE_AFTER_S:
        return f"nothing in it changed for {idle_s:.0f} s"
    return None


def _is_running(pid: int, started_at: float | None) -> bool:
    """Whether process ``pid`` is alive and, with ``started_at`` (psutil's ``create_time``), still
    the process that started then rather than a later one given the same pid."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return (proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
                    and (started_at is None or proc.create_time() == started_at))
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone else's process, alive
        return True


def _read_owner(staging: Path) -> dict[str, object] | None:
    try:
        owner = json.loads((staging / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _last_change(directory: Path) -> float:
    latest = 0.0
    for path in (directory, *directory.iterdir()) if directory.is_dir() else (directory,):
        try:
            latest = max(latest, path.stat().st_mtime)
        except OSError:
            continue
    return latest


def remove_stale(final: Path) -> list[Path]:
    """Delete staging directories of earlier saves to ``final`` that will never finish; returns
    them. A live save's staging directory is kept, and so are set-aside old checkpoints while
    ``final`` is missing (they may be the only copy).

    Example::

        remove_stale(Path("/ck/step10"))   # [Path('/ck/.step10.tmp-9f3c')] after a crash
    """
    removed = []
    for staging in sorted(final.parent.glob(f".{final.name}.tmp-*")):
        reason = stale_reason(staging)
        if reason is None:
            log.info("keeping %s: a save that may still be running owns it", staging)
            continue
        log.warning("removing %s, left by a checkpoint save that did not finish (%s)", staging, reason)
        shutil.rmtree(staging, ignore_errors=True)
        removed.append(staging)
    if final.exists():
        for aside in sorted(final.parent.glob(f".{final.name}.old-*")):
            log.warning("removing %s, an old checkpoint a crashed save had set aside", aside)
            try:
                _remove(aside)
            except OSError as exc:
                log.warning("could not remove %s (%s: %s)", aside, type(exc).__name__, exc)
                continue
            removed.append(aside)
    return removed


def _remove(path: Path) -> None:
    """Delete a set-aside checkpoint: a directory with what it holds, or a link (not its target)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def publish(staging: Path, final: Path, token: str) -> None:
    """Move the complete checkpoint ``staging`` to ``final``, replacing what is there; raises
    ``OSError`` with ``final`` as it was when the new one cannot be put in place.

    Example::

        publish(Path("/ck/.step10.tmp-ab12"), Path("/ck/step10"), "ab12")
    """
    (staging / OWNER_FILE).unlink(missing_ok=True)
    sync_dir(staging)  # the data files' entries are durable before the directory becomes visible
    aside = None
    if final.exists() or final.is_symlink():
        aside = _aside_dir(final, token)
        os.rename(final, aside)
    try:
        os.rename(staging, final)
    except OSError:
        if aside is not None:
            os.rename(aside, final)  # put the old checkpoint back
        raise
    sync_dir(final.parent)
    if aside is not None:
        try:
            _remove(aside)
        except OSError as exc:  # the new checkpoint is in place: the save succeeded
            log.warning("checkpoint %s is saved, but its previous copy %s could not be removed "
                        "(%s: %s); the next save to this path removes it", final, aside,
                        type(exc).__name__, exc)


def sync_dir(directory: Path) -> None:
    """Make ``directory``'s entries (files created, renamed or removed in it) durable.

    Example::

        sync_dir(Path("/ck"))   # after a rename inside /ck
    """
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
