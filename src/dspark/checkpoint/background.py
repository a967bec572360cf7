"""Checkpoints written while training goes on (``engine.save(path, async_save=True)``).

[Note: asynchronous save] The save is split where the engine stops mattering: in the caller's
thread, every rank agrees on the path, makes its buffers equal, and copies its state into CPU memory
(:func:`dspark.checkpoint.storage.stage_on_cpu`); then one background thread per process writes that
copy through DCP, writes the JSON files and publishes the directory exactly as a synchronous save
does ([Note: atomic save]). Training changes the engine's tensors freely meanwhile.

The background thread runs its collectives (DCP's planning, the agreement on failures, the publish
outcome) on a process group of its own, a gloo group created by the first asynchronous save: two
threads issuing collectives on one group could interleave them differently on different ranks. One
save is in flight at a time: the next save, ``engine.load`` and ``dspark.shutdown()`` first wait for
it, and raise its error if it failed (on every rank: the background thread agrees on failures like a
synchronous save). A crash while it writes leaves only the staging directory behind; the checkpoint
previously at the path is untouched, and the next save removes the leftover (its owner is gone).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dspark import comm

__all__ = ["pending_save_path", "side_group", "submit", "wait_for_pending_save"]

log = logging.getLogger(__name__)

_executor: ThreadPoolExecutor | None = None
_pending: tuple[Path, Future[Path]] | None = None
_side: comm.Group | None = None


def side_group() -> comm.Group:
    """The gloo group background saves coordinate over, created on first use. Collective the first
    time: every rank calls it at the same point (inside ``engine.save``).

    Example::

        group = side_group()   # comm.Group(size=world_size, device=cpu)
    """
    global _side
    if _side is None:
        _side = comm.new_group(backend="gloo")
    return _side


def submit(path: Path, job: Callable[[], Path]) -> None:
    """Run ``job`` (the write and publication of ``path``) in the background thread. The caller has
    waited for the previous save (:func:`wait_for_pending_save`).

    Example::

        submit(final, lambda: write_and_publish(job, side_group()))
    """
    global _executor, _pending
    if _pending is not None:
        raise AssertionError(f"a save to {_pending[0]} is still pending: wait for it first")
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-checkpoint")
    _pending = (path, _executor.submit(job))


def pending_save_path() -> Path | None:
    """Where the save in flight will publish its checkpoint; None when none is in flight or the
    last one has finished.

    Example::

        engine.save("ckpt/step-100", async_save=True)
        pending_save_path()   # PosixPath('/.../ckpt/step-100') while it is written
    """
    if _pending is None or _pending[1].done():
        return None
    return _pending[0]


def wait_for_pending_save() -> Path | None:
    """Block until the save in flight (if any) is published; returns its path, or None when there
    was none. Raises its :class:`~dspark.checkpoint.CheckpointSaveError` if it failed (once: the
    failed save is then forgotten). ``engine.save``, ``engine.load`` and ``dspark.shutdown()`` call it.

    Example::

        engine.save("ckpt/step-100", async_save=True)
        ...                                          # train on
        dspark.checkpoint.wait_for_pending_save()    # PosixPath('/.../ckpt/step-100')
    """
    global _pending
    if _pending is None:
        return None
    _path, future = _pending
    try:
        return future.result()
    finally:
        _pending = None


def _on_shutdown() -> None:
    global _side
    try:
        wait_for_pending_save()
    finally:
        _side = None  # comm destroys the group itself; a new world gets a new one


comm.add_shutdown_hook(_on_shutdown)
