"""Whether the default group's collectives go through shared memory, and the transport that
carries them when they do (:mod:`dspark.comm.shm_transport`): the settings (``DSPARK_SHM``,
``DSPARK_SHM_MB``), every rank's vote at ``init``, the file under /dev/shm, and the transport in
use until shutdown. :mod:`dspark.comm.collectives` asks :func:`through_shm` at every collective.
"""

from __future__ import annotations

import os
import socket
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist

from dspark.comm.shm_transport import (
    ALIGN,
    DTYPE_CODES,
    SHM_ENV,
    SHM_MB_ENV,
    ShmTransport,
    mapping_bytes,
)
from dspark.comm.world_state import get_world

__all__ = ["DEFAULT_REGION_MB", "active_transport", "create_file", "create_mapping", "new_path",
           "region_bytes", "shm_free_bytes", "shm_wanted", "start_shm_transport", "stop_shm_transport",
           "through_shm", "transport"]

DEFAULT_REGION_MB = 16
"""Each rank's data region when ``DSPARK_SHM_MB`` is not set."""


def shm_wanted(world_size: int, local_world_size: int, backend: str, device_type: str) -> bool:
    """Whether the default group should run through shared memory (every rank on this machine)."""
    setting = os.environ.get(SHM_ENV, "1").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return False
    if setting not in ("1", "on", "true", "yes", ""):
        raise ValueError(f"{SHM_ENV}={os.environ[SHM_ENV]!r}: use 1 (the default: shared memory "
                         f"between ranks of one machine) or 0 (gloo for everything)")
    return (backend == "gloo" and device_type == "cpu" and world_size > 1
            and local_world_size == world_size and os.uname().machine.lower() in ("x86_64", "amd64")
            and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))


def region_bytes() -> int:
    """Each rank's data region in bytes, from ``DSPARK_SHM_MB`` (``DEFAULT_REGION_MB`` by default)."""
    raw = os.environ.get(SHM_MB_ENV, "")
    try:
        mb = float(raw) if raw.strip() else float(DEFAULT_REGION_MB)
    except ValueError:
        raise ValueError(f"{SHM_MB_ENV}={raw!r} is not a number of MiB") from None
    if not mb >= 1:
        raise ValueError(f"{SHM_MB_ENV}={raw!r}: each rank's region needs at least 1 MiB")
    return int(mb * 2**20) // ALIGN * ALIGN


def shm_free_bytes() -> int:
    """What /dev/shm has free, in bytes."""
    stat = os.statvfs("/dev/shm")
    return stat.f_bavail * stat.f_frsize


def new_path() -> str:
    """A fresh name for the shared file under /dev/shm."""
    return f"/dev/shm/dspark-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def create_file(path: str, nbytes: int) -> None:
    """The shared file, its pages reserved now: a page tmpfs could not give on first write would
    kill the process with SIGBUS."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


_active: ShmTransport | None = None


def through_shm(pg: Any, *tensors: torch.Tensor) -> ShmTransport | None:
    """The shared-memory transport when it can carry this collective: the default group (``pg``,
    the group's process group, is None) of a job on one machine, contiguous CPU tensors of a dtype
    it knows. Every rank decides alike (the same tensors' dtypes and devices in a correct program)."""
    shm = _active
    if shm is None or pg is not None:
        return None
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in DTYPE_CODES:
            return None
    return shm


def transport() -> str:
    """How the default group's tensors travel: ``"shm"`` (shared memory, every rank on this
    machine), or the process group's backend (``"gloo"``, ``"nccl"``), or ``"none"``."""
    world = get_world()
    return "shm" if _active is not None else world.backend


def start_shm_transport() -> None:
    """Set up the shared-memory transport for the default group when every rank runs on this
    machine (called by ``init`` on every rank, right after the process group exists)."""
    global _active
    world = get_world()
    wanted = shm_wanted(world.world_size, world.local_world_size, world.backend,
                                 world.device.type)
    region = region_bytes() if wanted else 0
    votes: list[Any] = [None] * world.world_size
    dist.all_gather_object(votes, (wanted, region, socket.gethostname()))
    if not all(v[0] for v in votes) or len({(v[1], v[2]) for v in votes}) != 1:
        return
    nbytes = mapping_bytes(world.world_size, region)
    token = int.from_bytes(os.urandom(7), "little")
    made: list[Any] = [None, token]
    if world.rank == 0:
        made[0] = create_mapping(nbytes)
    dist.broadcast_object_list(made, src=0)
    path, token = made
    if path is None:
        return
    transport_: ShmTransport | None = None
    try:
        transport_ = ShmTransport(str(path), world.rank, world.world_size, region, world.timeout_s)
        if world.rank == 0:
            transport_.stamp(int(token))
    except OSError:
        transport_ = None
    dist.barrier()
    opened: list[Any] = [None] * world.world_size
    dist.all_gather_object(opened, (transport_ is not None and transport_.sees(int(token)),
                                    os.getpid()))
    if transport_ is not None:
        transport_.watch([pid for _, pid in opened])
    if world.rank == 0:
        os.unlink(str(path))  # every rank holds its mapping: the memory goes with the last one
    if all(ok for ok, _ in opened):
        _active = transport_
    elif transport_ is not None:
        transport_.close()


def create_mapping(nbytes: int) -> str | None:
    """A shared file of ``nbytes`` in /dev/shm with its pages reserved (a write to a page tmpfs
    cannot give would kill the process with SIGBUS), or None with a warning. It takes at most a
    quarter of what /dev/shm has free: DataLoader workers pass their batches through it too (a
    container's default /dev/shm is 64 MB)."""
    path = new_path()
    try:
        free = shm_free_bytes()
        if nbytes > free // 4:
            raise OSError(f"/dev/shm has {free / 2**20:.0f} MiB free, and DSpark takes at most a "
                          f"quarter of it")
        create_file(path, nbytes)
    except OSError as exc:
        try:
            os.unlink(path)
        except OSError:
            pass
        warnings.warn(f"DSpark: no shared memory for the ranks' collectives ({exc}); they go "
                      f"through gloo. Free /dev/shm or set {SHM_MB_ENV} lower "
                      f"({nbytes / 2**20:.0f} MiB were asked for), or {SHM_ENV}=0 to "
                      f"silence this", RuntimeWarning, stacklevel=3)
        return None
    return path


def stop_shm_transport() -> None:
    """Close the transport, if one runs (``release_groups`` at shutdown)."""
    global _active
    shm, _active = _active, None
    if shm is not None:
        shm.close()


def active_transport() -> ShmTransport | None:
    """The shared-memory transport the default group runs on now, or None (gloo, NCCL, one rank)."""
    return _active
