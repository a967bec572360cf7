"""How many workers this node can give a device of its own: one GPU each, or one CPU core each. Read
without importing torch (``dspark run`` starts before any worker, and PyTorch's import would cost it
a second or two): the NVIDIA driver lists its GPUs under ``/proc/driver/nvidia/gpus``, and
``CUDA_VISIBLE_DEVICES`` narrows what a process sees.

``dspark run --nproc N`` above that count is an error unless ``--oversubscribe``: ``--nproc 100000``
once started some ten thousand processes, and workers that time-share a core or a GPU give step
times that mislead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LocalDevices", "check_fits", "local_devices"]

_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True, slots=True)
class LocalDevices:
    """The devices of this node a worker can have to itself."""

    gpus: int
    """GPUs visible to this process."""
    cores: int
    """CPU cores this process may run on."""


def _visible_gpus(environ: Mapping[str, str], driver_gpus: Path) -> int:
    try:
        installed = sum(1 for _ in driver_gpus.iterdir())
    except OSError:
        return 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    listed = []
    for entry in visible.split(","):  # CUDA stops at the first invalid entry ("-1", "")
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        listed.append(entry)
    return min(len(listed), installed)


def local_devices(environ: Mapping[str, str] | None = None,
                  driver_gpus: Path = _NVIDIA_GPUS) -> LocalDevices:
    """This node's GPUs visible to this process and the CPU cores it may run on.

    Example::

        local_devices()   # LocalDevices(gpus=0, cores=2) on a 2-core box without GPUs
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return LocalDevices(gpus=_visible_gpus(os.environ if environ is None else environ, driver_gpus),
                        cores=cores or 1)


def check_fits(nproc: int, *, oversubscribe: bool, devices: LocalDevices | None = None) -> str | None:
    """Raise ``ValueError`` when ``nproc`` workers would not each get a device of this node (a GPU,
    or a CPU core), unless ``oversubscribe``; the message names both numbers and the fix. Returns a
    warning when GPUs are visible but fewer than ``nproc``: ``backend="auto"`` then runs the
    workers on CPU cores (gloo), one GPU per worker being impossible.

    Example::

        check_fits(4, oversubscribe=False, devices=LocalDevices(gpus=0, cores=2))   # ValueError
    """
    have = local_devices() if devices is None else devices
    if not oversubscribe and nproc > max(have.gpus, have.cores):
        gpus = f"{have.gpus} GPU(s) and " if have.gpus else ""
        raise ValueError(f"nproc={nproc} workers on this node, which has {gpus}{have.cores} CPU "
                         f"core(s) for them (one device each); pass nproc={max(have.gpus, have.cores)} "
                         f"or fewer, or oversubscribe=True to share them (slower, and step times "
                         f"then mislead)")
    if 0 < have.gpus < nproc:
        return (f"{nproc} workers and {have.gpus} visible GPU(s): with backend='auto' the workers run "
                f"on CPU cores (gloo), not on the GPUs; pass nproc={have.gpus} for one GPU each")
    return None
