"""``dspark env``'s report: versions, CPU, memory, NUMA, GPUs, InfiniBand and the network.

:func:`collect_environment` gathers what a bug report about scaling needs, and what a user checks
on a node before a multi-node launch. Every probe reports what it saw and never guesses: hardware
that is not there comes back as an empty list (``"cuda_devices": []``, ``"infiniband": []``) with
the reason under ``"not_found"``, and a probe that cannot decide says ``None``. Nothing here
raises because a tool or a file is missing.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dspark.comm import available_backends
from dspark.host._files import NOT_FOUND
from dspark.host.cpu_memory import cpu_info, memory_info, numa_nodes
from dspark.host.gpus import (
    cuda_devices,
    memory_coherence,
    nvidia_smi,
    nvidia_smi_gpus,
    nvlink_links,
    parse_addressing_mode,
)
from dspark.host.infiniband import infiniband_devices, nccl_ib_selection
from dspark.host.network import network_report, resolve_host

__all__ = ["collect_environment"]

_log = logging.getLogger(__name__)


def _versions() -> dict[str, Any]:
    import torch

    from dspark._version import __version__

    nccl = None
    if torch.version.cuda:
        try:
            raw = torch.cuda.nccl.version()
            nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
        except Exception as exc:  # a CUDA build on a machine without the library still reports
            _log.debug("NCCL version unavailable: %s", exc)
    return {"dspark": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "torch_cuda": torch.version.cuda, "torch_nccl": nccl,
            "torch_hip": getattr(torch.version, "hip", None)}


def collect_environment(*, sys_root: str | Path = "/sys", proc_root: str | Path = "/proc",
                        probe_gpus: bool = True, environ: Mapping[str, str] | None = None,
                        nnodes: int = 1, master_addr: str | None = None, hostname: str | None = None,
                        resolve: Callable[[str], list[str]] = resolve_host) -> dict[str, Any]:
    """Everything ``dspark env`` reports, as a JSON-ready dict.

    Absent hardware is an empty list and a reason under ``"not_found"``; ``probe_gpus=False``
    skips CUDA and nvidia-smi (reported as not probed), for tests on fake ``/sys`` trees.
    ``environ`` (default: this process's), ``nnodes`` and ``master_addr`` describe the launch the
    network section checks (:func:`dspark.host.network.network_report`); ``"warnings"`` gathers
    what would break it.

    Example::

        env = collect_environment()
        env["cpu"]["usable_cores"], env["cuda_devices"], env["not_found"].get("infiniband")
    """
    environ = os.environ if environ is None else environ
    cpu = cpu_info(proc_root)
    devices = cuda_devices() if probe_gpus else []
    smi_gpus = nvidia_smi_gpus() if probe_gpus else None
    has_gpu = bool(devices or smi_gpus)
    smi_query = nvidia_smi("-q") if has_gpu else None
    modes = parse_addressing_mode(smi_query) if smi_query is not None else None
    nvlink = nvlink_links() if has_gpu else None
    infiniband = infiniband_devices(sys_root)
    nccl_ib = nccl_ib_selection(environ.get("NCCL_IB_HCA"), infiniband)
    network = network_report(sys_root=sys_root, proc_root=proc_root, environ=environ, nnodes=nnodes,
                             master_addr=master_addr, hostname=hostname, resolve=resolve)
    env: dict[str, Any] = {
        "versions": _versions(),
        "os": {"system": platform.system(), "release": platform.release(),
               "platform": platform.platform(), "python_executable": sys.executable},
        "cpu": cpu,
        "memory": memory_info(proc_root),
        "numa_nodes": numa_nodes(sys_root),
        "cuda_devices": devices,
        "nvidia_smi_gpus": smi_gpus,
        "memory_coherence": memory_coherence(arch=cpu["arch"], devices=devices, addressing_modes=modes),
        "nvlink": nvlink,
        "infiniband": infiniband,
        "nccl_ib": nccl_ib,
        "network": network,
        "backends": available_backends(),
        "warnings": [*network["warnings"], *nccl_ib["problems"]],
    }
    not_found: dict[str, str] = {}
    if not devices:
        not_found["cuda_devices"] = (f"{NOT_FOUND}: torch.cuda.is_available() is False" if probe_gpus
                                     else "not probed")
    if smi_gpus is None:
        not_found["nvidia_smi_gpus"] = (f"{NOT_FOUND}: nvidia-smi unavailable" if probe_gpus
                                        else "not probed")
    elif smi_gpus and not devices:
        not_found["cuda_devices"] += (f" although nvidia-smi sees {len(smi_gpus)} GPU(s): "
                                      "is this a CPU-only PyTorch build?")
    if nvlink is None:
        not_found["nvlink"] = (f"{NOT_FOUND}: no GPU" if not has_gpu
                               else f"{NOT_FOUND}: nvidia-smi unavailable")
    elif not nvlink["pairs"] and not any(g["active_links"] for g in nvlink["per_gpu"]):
        not_found["nvlink"] = f"{NOT_FOUND}: nvidia-smi reports no active NVLink"
    if not env["infiniband"]:
        not_found["infiniband"] = f"{NOT_FOUND}: no devices in {Path(sys_root) / 'class/infiniband'}"
    if not env["numa_nodes"]:
        not_found["numa_nodes"] = f"{NOT_FOUND}: no nodes in {Path(sys_root) / 'devices/system/node'}"
    if env["memory"]["total_bytes"] is None:
        not_found["memory"] = f"{NOT_FOUND}: {Path(proc_root) / 'meminfo'} unreadable"
    if cpu["model"] is None:
        not_found["cpu_model"] = f"{NOT_FOUND}: no model line in {Path(proc_root) / 'cpuinfo'}"
    env["not_found"] = not_found
    return env
