"""Process-group lifecycle: ``init`` reads PyTorch's launcher environment (or runs as a single
process), picks the backend and the device, and ``shutdown`` tears it down without aborting.

The lifecycle sits above the collectives (it starts the shared-memory transport once the group
exists and drops the side groups before the group goes); the world they both read is kept in
:mod:`dspark.comm.world_state`, below either."""

from __future__ import annotations

import atexit
import datetime as _dt
import gc
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from dspark.comm import collectives, shm_setup
from dspark.comm.world_state import World, get_world, is_initialized, set_world

__all__ = ["BACKENDS", "World", "add_shutdown_hook", "available_backends", "choose_backend", "get_world",
           "init", "is_initialized", "shutdown"]

BACKENDS = ("auto", "gloo", "nccl", "mpi")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE")




def available_backends() -> list[str]:
    """The process-group backends built into this PyTorch (``nccl`` also needs a CUDA device)."""
    names = []
    if dist.is_available():
        if dist.is_gloo_available():
            names.append("gloo")
        if dist.is_nccl_available() and torch.cuda.is_available():
            names.append("nccl")
        if dist.is_mpi_available():
            names.append("mpi")
    return names


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def choose_backend(backend: str, local_world_size: int) -> str:
    """The backend ``init(backend=...)`` uses with ``local_world_size`` ranks on this machine:
    ``"auto"`` resolved, any other choice checked.

    Example::

        choose_backend("auto", local_world_size=1)   # "nccl" with a GPU per rank
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}")
    have = available_backends()
    if backend == "auto":
        cuda_per_rank = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
        return "nccl" if cuda_per_rank and "nccl" in have else "gloo"
    if backend not in have:
        raise ValueError(
            f"backend={backend!r} is not available in this PyTorch build on this machine; "
            f"available: {', '.join(have) or 'none'} (use backend='auto' to choose for you)"
        )
    return backend


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timeout_seconds(timeout: float | _dt.timedelta) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, _dt.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    return seconds


def init(backend: str = "auto", *, timeout: float | _dt.timedelta = 300.0) -> World:
    """Join the job started by ``dspark run`` / ``torchrun``, or run as one process.

    With the launcher's environment (``RANK``, ``WORLD_SIZE``, ...) this creates the default
    process group. Without it, ``backend="auto"`` gives a single-process stand-in where every
    collective is a no-op, and an explicit backend creates a real one-rank group on loopback.
    ``timeout`` (seconds) bounds every collective: a rank that never joins raises
    :class:`dspark.CollectiveTimeoutError` instead of hanging.

    Example::

        world = dspark.init()
        print(world.rank, world.world_size, world.device)
    """
    timeout_s = _timeout_seconds(timeout)
    if is_initialized():
        current = get_world()
        if backend not in ("auto", current.backend):
            raise ValueError(f"dspark.init(backend={backend!r}): already initialised with backend "
                             f"{current.backend!r}; call dspark.shutdown() first to change it")
        return current
    launched = all(name in os.environ for name in _LAUNCHER_VARS)
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank if launched else 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size if launched else 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")

    if not launched and backend == "auto":
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        alone = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=device,
                      backend="none", timeout_s=timeout_s)
        set_world(alone)
        return alone

    chosen = choose_backend(backend, local_world_size)
    if chosen == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kwargs: dict[str, object] = {}
    if chosen == "nccl":
        kwargs["device_id"] = device
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if launched and restart is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store for all restarts of the worker group, and the process group's keys
        # carry no attempt number: a restarted rank could read a dead peer's address left by the
        # previous attempt (gloo then fails to connect). Each attempt gets its own key prefix.
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    world_size, is_master=False,
                                    timeout=_dt.timedelta(seconds=timeout_s))
        kwargs["store"] = dist.PrefixStore(f"dspark/attempt_{restart}", agent_store)
        init_method = None
    elif launched:
        init_method = "env://"
    else:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    dist.init_process_group(
        backend=chosen, init_method=init_method, rank=rank, world_size=world_size,
        timeout=_dt.timedelta(seconds=timeout_s), **kwargs,  # type: ignore[arg-type]
    )
    world = World(rank=rank, world_size=world_size, local_rank=local_rank,
                  local_world_size=local_world_size, device=device, backend=chosen,
                  timeout_s=timeout_s)
    set_world(world)

    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_shutdown_at_exit)
        _exit_hook_registered = True
    try:
        shm_setup.start_shm_transport()  # every rank on this machine: tensors go through shared memory
    except BaseException:
        shutdown()
        raise
    return world


_shutdown_hooks: list[Callable[[], None]] = []
_exit_hook_registered = False


def _shutdown_at_exit() -> None:
    """:func:`shutdown` for a script that ends without calling it. Left to the interpreter's own
    teardown, the process group and the shared-memory transport go in whatever order finalisation
    picks, and gloo then aborts the process now and then ("terminate called without an active
    exception", exit code -6) after a run that succeeded."""
    if not is_initialized():
        return
    try:
        shutdown()
    except Exception as exc:  # the interpreter is leaving anyway: say why the exit was not clean
        print(f"dspark: shutdown at exit failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def add_shutdown_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` at the start of every :func:`shutdown`, while the process groups still exist
    (how a checkpoint written in the background is finished before its group goes). Added once.

    Example::

        add_shutdown_hook(wait_for_pending_save)
    """
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)


def shutdown() -> None:
    """Leave the job. Runs the shutdown hooks first (an error from one is raised once the job is
    left), and collects garbage so that no model or optimizer still references the process group
    when it is destroyed (gloo aborts at exit otherwise)."""
    failure: BaseException | None = None
    for hook in list(_shutdown_hooks):
        try:
            hook()
        except Exception as exc:  # leave the job anyway; the first error is raised at the end
            failure = failure or exc
    collectives.release_groups()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    set_world(None)
    gc.collect()
    if failure is not None:
        raise failure
