"""CPU, host memory and NUMA nodes, from ``/proc`` and ``/sys`` (roots are parameters for tests)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

from dspark.host._files import kib_field, read_text

__all__ = ["cpu_info", "memory_info", "numa_nodes"]


def cpu_info(proc_root: str | Path = "/proc") -> dict[str, Any]:
    """Logical cores, the cores this process may use (its affinity) and the CPU model.

    Example::

        cpu_info()   # {'model': 'AMD EPYC', 'logical_cores': 2, 'usable_cores': 2, 'arch': 'x86_64'}
    """
    cpuinfo = read_text(Path(proc_root) / "cpuinfo") or ""
    model = None
    # x86 says "model name"; some ARM kernels say "Model" or "Hardware"; others say neither.
    for key in ("model name", "Model", "Hardware"):
        match = re.search(rf"^{key}\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
        if match:
            model = match.group(1).strip()
            break
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"model": model, "logical_cores": os.cpu_count(), "usable_cores": usable,
            "arch": platform.machine()}


def memory_info(proc_root: str | Path = "/proc") -> dict[str, Any]:
    """Total and available host memory in bytes from ``/proc/meminfo`` (``None`` when unreadable).

    Example::

        memory_info()["total_bytes"]   # 5731725312
    """
    text = read_text(Path(proc_root) / "meminfo") or ""
    return {"total_bytes": kib_field(text, "MemTotal"),
            "available_bytes": kib_field(text, "MemAvailable")}


def numa_nodes(sys_root: str | Path = "/sys") -> list[dict[str, Any]]:
    """NUMA nodes from ``/sys/devices/system/node``: id, CPU list and memory; ``[]`` when absent.

    Example::

        numa_nodes()   # [{'id': 0, 'cpus': '0-1', 'memory_total_bytes': 5731725312}]
    """
    base = Path(sys_root) / "devices/system/node"
    nodes = []
    for entry in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = read_text(entry / "meminfo") or ""
        nodes.append({"id": int(entry.name[4:]), "cpus": read_text(entry / "cpulist"),
                      "memory_total_bytes": kib_field(meminfo, "MemTotal")})
    return nodes
