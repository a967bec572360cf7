"""What this machine is: versions, CPU, memory, NUMA, GPUs, coherent memory, NVLink, InfiniBand.

:func:`collect_environment` gathers what a bug report about scaling needs (``dspark env`` prints
it). Every probe reports what it saw and never guesses: hardware that is not there comes back as an
empty list (``"cuda_devices": []``, ``"infiniband": []``) with the reason under ``"not_found"``,
and a probe that cannot decide says ``None``. Nothing here raises because a tool or a file is
missing. The ``/sys`` and ``/proc`` roots are parameters so that tests can point them at fake trees.

[Note: coherent memory] On an integrated GPU (DGX Spark's GB10) or a Grace host attached over
NVLink-C2C (GH200), CPU and GPU share coherent memory: a "copy to device" may be no copy at all,
and NVML cannot report per-GPU memory there. Evidence, strongest first: PyTorch's
``is_integrated`` device property, then ``nvidia-smi -q``'s "Addressing Mode" (``ATS`` is
hardware-coherent; ``HMM`` is the driver migrating pages, not coherence). An aarch64 host with an
NVIDIA GPU and neither signal is reported as unknown, not as coherent.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "collect_environment",
    "cpu_info",
    "cuda_devices",
    "infiniband_devices",
    "memory_coherence",
    "memory_info",
    "numa_nodes",
    "nvidia_smi_gpus",
    "nvlink_links",
    "parse_addressing_mode",
    "parse_nvlink_status",
    "parse_smi_gpus",
    "parse_topo_matrix",
]

_log = logging.getLogger(__name__)

NOT_FOUND = "not found"
_SMI_TIMEOUT_S = 5.0


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _kib_field(text: str, name: str) -> int | None:
    match = re.search(rf"^(?:Node \d+ )?{name}:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


# -- CPU and memory -------------------------------------------------------------------------------
def cpu_info(proc_root: str | Path = "/proc") -> dict[str, Any]:
    """Logical cores, the cores this process may use (its affinity) and the CPU model.

    Example::

        cpu_info()   # {'model': 'AMD EPYC', 'logical_cores': 2, 'usable_cores': 2, 'arch': 'x86_64'}
    """
    cpuinfo = _read(Path(proc_root) / "cpuinfo") or ""
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
    text = _read(Path(proc_root) / "meminfo") or ""
    return {"total_bytes": _kib_field(text, "MemTotal"),
            "available_bytes": _kib_field(text, "MemAvailable")}


def numa_nodes(sys_root: str | Path = "/sys") -> list[dict[str, Any]]:
    """NUMA nodes from ``/sys/devices/system/node``: id, CPU list and memory; ``[]`` when absent.

    Example::

        numa_nodes()   # [{'id': 0, 'cpus': '0-1', 'memory_total_bytes': 5731725312}]
    """
    base = Path(sys_root) / "devices/system/node"
    nodes = []
    for entry in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = _read(entry / "meminfo") or ""
        nodes.append({"id": int(entry.name[4:]), "cpus": _read(entry / "cpulist"),
                      "memory_total_bytes": _kib_field(meminfo, "MemTotal")})
    return nodes


# -- GPUs ------------------------------------------------------------------------------------------
def cuda_devices() -> list[dict[str, Any]]:
    """CUDA devices PyTorch sees: name, total memory, compute capability, integrated or not.

    ``is_integrated`` is ``None`` when this PyTorch does not expose the property.

    Example::

        cuda_devices()   # [] on a CPU-only machine
    """
    import torch

    if not torch.cuda.is_available():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        integrated = getattr(props, "is_integrated", None)
        devices.append({
            "index": index,
            "name": props.name,
            "total_memory_bytes": int(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": int(props.multi_processor_count),
            "is_integrated": None if integrated is None else bool(integrated),
        })
    return devices


def _nvidia_smi(*args: str, timeout_s: float = _SMI_TIMEOUT_S) -> str | None:
    """``nvidia-smi ARGS`` output, or ``None`` when it is missing, fails or hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        _log.debug("nvidia-smi %s failed: %s", " ".join(args), exc)
        return None
    return done.stdout if done.returncode == 0 else None


def parse_addressing_mode(smi_query: str) -> list[str]:
    """Each GPU's "Addressing Mode" from ``nvidia-smi -q`` (e.g. ``['ATS']``; ``[]`` if none).

    Example::

        parse_addressing_mode("    Addressing Mode                  : ATS\\n")   # ['ATS']
    """
    return re.findall(r"^\s*Addressing Mode\s*:\s*(\S+)", smi_query, re.MULTILINE)


def memory_coherence(*, arch: str, devices: list[dict[str, Any]],
                     addressing_modes: list[str] | None) -> dict[str, Any]:
    """Whether GPU memory is coherent with the CPU's, and the evidence (see the module's note).

    ``coherent`` is ``True`` / ``False`` when the evidence says so and ``None`` when it cannot be
    told (or when there is no GPU). ``addressing_modes`` is ``None`` when nvidia-smi was unavailable.

    Example::

        memory_coherence(arch="aarch64", devices=[{"index": 0, "is_integrated": True}],
                         addressing_modes=None)["coherent"]   # True
    """
    if not devices:
        return {"coherent": None, "kind": "no CUDA device", "evidence": []}
    evidence = [f"cuda:{d['index']} is_integrated={d['is_integrated']}" for d in devices
                if d.get("is_integrated") is not None]
    if addressing_modes:
        evidence.append(f"nvidia-smi Addressing Mode: {', '.join(addressing_modes)}")
    if any(d.get("is_integrated") for d in devices):
        return {"coherent": True, "kind": "integrated GPU (one shared memory)", "evidence": evidence}
    if addressing_modes and "ATS" in addressing_modes:
        return {"coherent": True, "kind": "ATS (hardware-coherent, e.g. NVLink-C2C)", "evidence": evidence}
    if arch in ("aarch64", "arm64") and addressing_modes is None:
        evidence.append(f"{arch} host with an NVIDIA GPU (Grace/NVLink-C2C possible; nvidia-smi "
                        "unavailable to confirm)")
        return {"coherent": None, "kind": "unknown", "evidence": evidence}
    known_discrete = all(d.get("is_integrated") is False for d in devices)
    if addressing_modes and "HMM" in addressing_modes:
        kind = "HMM (driver-migrated pages, not hardware-coherent)"
        return {"coherent": False if known_discrete else None, "kind": kind, "evidence": evidence}
    if known_discrete:
        return {"coherent": False, "kind": "discrete GPU memory", "evidence": evidence}
    return {"coherent": None, "kind": "unknown", "evidence": evidence}


def parse_nvlink_status(text: str) -> list[dict[str, Any]]:
    """Active NVLink links per GPU from ``nvidia-smi nvlink --status``.

    Example::

        parse_nvlink_status("GPU 0: H100 (UUID: x)\\n\\t Link 0: 26.562 GB/s\\n\\t Link 1: <inactive>")
        # [{'gpu': 0, 'active_links': 1, 'link_gb_per_s': [26.562]}]
    """
    gpus: list[dict[str, Any]] = []
    for line in text.splitlines():
        head = re.match(r"^GPU (\d+):", line)
        if head:
            gpus.append({"gpu": int(head.group(1)), "active_links": 0, "link_gb_per_s": []})
            continue
        link = re.match(r"^\s*Link \d+:\s*([\d.]+)\s*GB/s", line)
        if link and gpus:
            gpus[-1]["active_links"] += 1
            gpus[-1]["link_gb_per_s"].append(float(link.group(1)))
    return gpus


def parse_topo_matrix(text: str) -> list[dict[str, Any]]:
    """GPU pairs joined by NVLink (``NV<k>`` cells) in ``nvidia-smi topo -m``, each pair once.

    Example::

        parse_topo_matrix("\\tGPU0\\tGPU1\\nGPU0\\t X \\tNV18\\nGPU1\\tNV18\\t X \\n")
        # [{'gpus': [0, 1], 'links': 18}]
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    columns = lines[0].split()
    pairs = []
    for line in lines[1:]:
        cells = line.split()
        row = re.fullmatch(r"GPU(\d+)", cells[0]) if cells else None
        if row is None:
            continue
        for name, cell in zip(columns, cells[1:], strict=False):
            col = re.fullmatch(r"GPU(\d+)", name)
            links = re.fullmatch(r"NV(\d+)", cell)
            if col and links and int(row.group(1)) < int(col.group(1)):
                pairs.append({"gpus": [int(row.group(1)), int(col.group(1))], "links": int(links.group(1))})
    return pairs


def parse_smi_gpus(csv_text: str) -> list[dict[str, Any]]:
    """GPUs from ``nvidia-smi --query-gpu=index,name,driver_version,memory.total
    --format=csv,noheader,nounits`` (memory in MiB; ``None`` where it says ``[N/A]``, as on
    unified-memory boxes).

    Example::

        parse_smi_gpus("0, NVIDIA H100, 550.54, 81559\\n")
        # [{'index': 0, 'name': 'NVIDIA H100', 'driver_version': '550.54', 'memory_total_mib': 81559}]
    """
    gpus = []
    for line in csv_text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        gpus.append({"index": int(cells[0]), "name": cells[1], "driver_version": cells[2],
                     "memory_total_mib": int(cells[3]) if cells[3].isdigit() else None})
    return gpus


def nvidia_smi_gpus() -> list[dict[str, Any]] | None:
    """The GPUs the NVIDIA driver sees, whatever PyTorch was built with (a CPU-only PyTorch on a GPU
    box shows up as GPUs here and none in :func:`cuda_devices`); ``None`` without nvidia-smi.

    Example::

        nvidia_smi_gpus()   # None on a machine without the NVIDIA driver
    """
    out = _nvidia_smi("--query-gpu=index,name,driver_version,memory.total",
                      "--format=csv,noheader,nounits")
    return None if out is None else parse_smi_gpus(out)


def nvlink_links() -> dict[str, Any] | None:
    """NVLink between GPUs as nvidia-smi reports it, or ``None`` when nvidia-smi is unavailable.

    Example::

        nvlink_links()   # None without nvidia-smi
    """
    status = _nvidia_smi("nvlink", "--status")
    topo = _nvidia_smi("topo", "-m")
    if status is None and topo is None:
        return None
    return {"per_gpu": parse_nvlink_status(status or ""), "pairs": parse_topo_matrix(topo or "")}


# -- InfiniBand ------------------------------------------------------------------------------------
def infiniband_devices(sys_root: str | Path = "/sys") -> list[dict[str, Any]]:
    """InfiniBand / RoCE adapters from ``/sys/class/infiniband``: name, firmware and each port's
    state, rate and link layer; ``[]`` when there are none.

    Example::

        infiniband_devices()   # [{'name': 'mlx5_0', 'ports': [{'port': 1, 'state': '4: ACTIVE', ...}]}]
    """
    base = Path(sys_root) / "class/infiniband"
    devices = []
    for dev in sorted(base.iterdir() if base.is_dir() else []):
        ports = []
        port_dirs = (dev / "ports").iterdir() if (dev / "ports").is_dir() else iter(())
        for port in sorted(port_dirs, key=lambda p: int(p.name) if p.name.isdigit() else 0):
            ports.append({"port": int(port.name) if port.name.isdigit() else port.name,
                          "state": _read(port / "state"), "phys_state": _read(port / "phys_state"),
                          "rate": _read(port / "rate"), "link_layer": _read(port / "link_layer")})
        devices.append({"name": dev.name, "fw_ver": _read(dev / "fw_ver"), "ports": ports})
    return devices


# -- everything ------------------------------------------------------------------------------------
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
                        probe_gpus: bool = True) -> dict[str, Any]:
    """Everything ``dspark env`` reports, as a JSON-ready dict.

    Absent hardware is an empty list and a reason under ``"not_found"``; ``probe_gpus=False``
    skips CUDA and nvidia-smi (reported as not probed), for tests on fake ``/sys`` trees.

    Example::

        env = collect_environment()
        env["cpu"]["usable_cores"], env["cuda_devices"], env["not_found"].get("infiniband")
    """
    from dspark.comm.world import available_backends

    cpu = cpu_info(proc_root)
    devices = cuda_devices() if probe_gpus else []
    smi_gpus = nvidia_smi_gpus() if probe_gpus else None
    has_gpu = bool(devices or smi_gpus)
    smi_query = _nvidia_smi("-q") if has_gpu else None
    modes = parse_addressing_mode(smi_query) if smi_query is not None else None
    nvlink = nvlink_links() if has_gpu else None
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
        "infiniband": infiniband_devices(sys_root),
        "backends": available_backends(),
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
