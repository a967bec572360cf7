"""GPUs: the CUDA devices PyTorch sees, the GPUs nvidia-smi sees, coherent memory and NVLink.

Every probe reports what it saw and never guesses: a missing nvidia-smi is ``None``, a CPU-only
machine ``[]``, and a probe that cannot decide says ``None``. nvidia-smi runs with a timeout, so a
wedged driver cannot hang ``dspark env``.

[Note: coherent memory] On an integrated GPU (DGX Spark's GB10) or a Grace host attached over
NVLink-C2C (GH200), CPU and GPU share coherent memory: a "copy to device" may be no copy at all,
and NVML cannot report per-GPU memory there. Evidence, strongest first: PyTorch's
``is_integrated`` device property, then ``nvidia-smi -q``'s "Addressing Mode" (``ATS`` is
hardware-coherent; ``HMM`` is the driver migrating pages, not coherence). An aarch64 host with an
NVIDIA GPU and neither signal is reported as unknown, not as coherent.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from typing import Any

__all__ = [
    "cuda_devices",
    "memory_coherence",
    "nvidia_smi",
    "nvidia_smi_gpus",
    "nvlink_links",
    "parse_addressing_mode",
    "parse_nvlink_status",
    "parse_smi_gpus",
    "parse_topo_matrix",
]

_log = logging.getLogger(__name__)

_SMI_TIMEOUT_S = 5.0


# -- CUDA devices, then nvidia-smi --------------------------------------------------------------
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


def nvidia_smi(*args: str, timeout_s: float = _SMI_TIMEOUT_S) -> str | None:
    """``nvidia-smi ARGS`` output, or ``None`` when it is missing, fails or hangs.

    Example::

        nvidia_smi("-q")   # None on a machine without the NVIDIA driver
    """
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
    out = nvidia_smi("--query-gpu=index,name,driver_version,memory.total",
                      "--format=csv,noheader,nounits")
    return None if out is None else parse_smi_gpus(out)


def nvlink_links() -> dict[str, Any] | None:
    """NVLink between GPUs as nvidia-smi reports it, or ``None`` when nvidia-smi is unavailable.

    Example::

        nvlink_links()   # None without nvidia-smi
    """
    status = nvidia_smi("nvlink", "--status")
    topo = nvidia_smi("topo", "-m")
    if status is None and topo is None:
        return None
    return {"per_gpu": parse_nvlink_status(status or ""), "pairs": parse_topo_matrix(topo or "")}
