"""Topology detection on fake /sys and /proc trees, canned nvidia-smi output, and this machine."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch

from dspark.comm import topology
from dspark.comm.topology import (
    collect_environment,
    infiniband_devices,
    memory_coherence,
    memory_info,
    numa_nodes,
    parse_addressing_mode,
    parse_nvlink_status,
    parse_smi_gpus,
    parse_topo_matrix,
)

TOPO_M = (
    "\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tSYS\tPIX\t0-47\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tNV4\tSYS\t0-47\t0\t\tN/A\n"
    "GPU2\tSYS\tNV4\t X \tSYS\t48-95\t1\t\tN/A\n"
    "NIC0\tPIX\tSYS\tSYS\t X \n\n"
    "Legend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
NVLINK_STATUS = (
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\n"
    "\t Link 0: 26.562 GB/s\n\t Link 1: 26.562 GB/s\n\t Link 2: <inactive>\n"
    "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)\n"
    "\t Link 0: <inactive>\n"
)
SMI_QUERY = "GPU 00000009:01:00.0\n    Product Name : NVIDIA GH200 480GB\n    Addressing Mode                       : ATS\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_roots(tmp_path: Path) -> tuple[Path, Path]:
    """A /sys with two NUMA nodes and one two-port InfiniBand adapter, and a /proc."""
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    for node, cpus, kib in ((0, "0-3", 1024), (1, "4-7", 2048)):
        _write(sys_root / f"devices/system/node/node{node}/cpulist", f"{cpus}\n")
        _write(sys_root / f"devices/system/node/node{node}/meminfo",
               f"Node {node} MemTotal:       {kib} kB\nNode {node} MemFree:  1 kB\n")
    _write(sys_root / "devices/system/node/online", "0-1\n")  # not a node directory
    ib = sys_root / "class/infiniband/mlx5_0"
    _write(ib / "fw_ver", "28.39.1002\n")
    for port, state in ((1, "4: ACTIVE"), (2, "1: DOWN")):
        _write(ib / f"ports/{port}/state", state + "\n")
        _write(ib / f"ports/{port}/rate", "200 Gb/sec (4X HDR)\n")
        _write(ib / f"ports/{port}/link_layer", "InfiniBand\n")
    _write(proc_root / "meminfo", "MemTotal:       8000 kB\nMemFree: 10 kB\nMemAvailable:   6000 kB\n")
    _write(proc_root / "cpuinfo", "processor\t: 0\nmodel name\t: Fake CPU 9000\n")
    return sys_root, proc_root


def test_fake_numa_nodes_are_read_in_order(fake_roots: tuple[Path, Path]) -> None:
    assert numa_nodes(fake_roots[0]) == [
        {"id": 0, "cpus": "0-3", "memory_total_bytes": 1024 * 1024},
        {"id": 1, "cpus": "4-7", "memory_total_bytes": 2048 * 1024},
    ]


def test_fake_infiniband_device_reports_each_port(fake_roots: tuple[Path, Path]) -> None:
    (dev,) = infiniband_devices(fake_roots[0])
    assert dev["name"] == "mlx5_0" and dev["fw_ver"] == "28.39.1002"
    assert [(p["port"], p["state"], p["rate"], p["link_layer"]) for p in dev["ports"]] == [
        (1, "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand"),
        (2, "1: DOWN", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ]


def test_fake_proc_memory_and_cpu_model(fake_roots: tuple[Path, Path]) -> None:
    assert memory_info(fake_roots[1]) == {"total_bytes": 8000 * 1024, "available_bytes": 6000 * 1024}
    env = collect_environment(sys_root=fake_roots[0], proc_root=fake_roots[1], probe_gpus=False)
    assert env["cpu"]["model"] == "Fake CPU 9000"
    assert env["cpu"]["usable_cores"] == len(os.sched_getaffinity(0))
    assert len(env["numa_nodes"]) == 2 and env["infiniband"][0]["name"] == "mlx5_0"
    assert "infiniband" not in env["not_found"] and "numa_nodes" not in env["not_found"]


def test_absent_hardware_is_reported_absent_not_guessed(tmp_path: Path) -> None:
    env = collect_environment(sys_root=tmp_path / "sys", proc_root=tmp_path / "proc", probe_gpus=False)
    assert env["infiniband"] == [] and env["numa_nodes"] == [] and env["cuda_devices"] == []
    assert env["memory"] == {"total_bytes": None, "available_bytes": None}
    assert env["cpu"]["model"] is None
    for key in ("infiniband", "numa_nodes", "memory", "cpu_model"):
        assert env["not_found"][key].startswith("not found"), key
    assert env["memory_coherence"]["coherent"] is None


def test_this_machine_reports_what_is_there() -> None:
    env = collect_environment()
    assert set(env) >= {"versions", "os", "cpu", "memory", "numa_nodes", "cuda_devices",
                        "memory_coherence", "nvlink", "infiniband", "backends", "not_found"}
    assert env["versions"]["torch"] == torch.__version__
    assert env["cpu"]["logical_cores"] == os.cpu_count()
    assert "gloo" in env["backends"]
    assert (env["cuda_devices"] == []) == (not torch.cuda.is_available())
    has_ib = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    assert bool(env["infiniband"]) == has_ib
    assert ("infiniband" in env["not_found"]) == (not has_ib)


def test_parsers_read_canned_nvidia_smi_output() -> None:
    assert parse_addressing_mode(SMI_QUERY) == ["ATS"]
    assert parse_addressing_mode("no such line") == []
    assert parse_topo_matrix(TOPO_M) == [{"gpus": [0, 1], "links": 18}, {"gpus": [1, 2], "links": 4}]
    assert parse_topo_matrix("") == []
    per_gpu = parse_nvlink_status(NVLINK_STATUS)
    assert [(g["gpu"], g["active_links"]) for g in per_gpu] == [(0, 2), (1, 0)]
    assert parse_smi_gpus("0, NVIDIA GB10, 580.95, [N/A]\n1, NVIDIA H100, 550.54, 81559\n") == [
        {"index": 0, "name": "NVIDIA GB10", "driver_version": "580.95", "memory_total_mib": None},
        {"index": 1, "name": "NVIDIA H100", "driver_version": "550.54", "memory_total_mib": 81559},
    ]


@pytest.mark.parametrize(("arch", "integrated", "modes", "coherent"), [
    ("aarch64", True, None, True),           # DGX Spark: integrated GB10
    ("aarch64", False, ["ATS"], True),       # GH200: discrete die, coherent over NVLink-C2C
    ("aarch64", None, None, None),           # Grace-like host, no evidence either way: unknown
    ("x86_64", False, None, False),          # a PCIe card
    ("x86_64", False, ["HMM"], False),       # HMM migrates pages; it is not coherence
    ("x86_64", None, None, None),            # an old PyTorch without is_integrated
])
def test_memory_coherence_follows_the_evidence(arch: str, integrated: bool | None,
                                               modes: list[str] | None, coherent: bool | None) -> None:
    devices = [{"index": 0, "is_integrated": integrated}]
    got = memory_coherence(arch=arch, devices=devices, addressing_modes=modes)
    assert got["coherent"] is coherent, got
    assert memory_coherence(arch=arch, devices=[], addressing_modes=modes)["coherent"] is None


def _fake_smi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_fake_nvidia_smi_is_read_and_cpu_only_torch_is_named(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    topo = tmp_path / "topo.txt"
    topo.write_text(TOPO_M)
    _fake_smi(tmp_path / "bin", f"""case "$1" in
  --query-gpu*) echo "0, NVIDIA H100, 550.54, 81559"; echo "1, NVIDIA H100, 550.54, 81559";;
  topo) cat {topo};;
  nvlink) exit 3;;
  -q) echo "    Addressing Mode : None";;
esac
""")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(topology, "cuda_devices", lambda: [])  # as a CPU-only PyTorch build sees it
    env = collect_environment(sys_root=tmp_path, proc_root=tmp_path)
    assert [g["index"] for g in env["nvidia_smi_gpus"]] == [0, 1]
    assert env["nvlink"]["pairs"][0] == {"gpus": [0, 1], "links": 18}
    assert env["nvlink"]["per_gpu"] == []  # `nvlink --status` failed: reported empty, not invented
    assert "CPU-only PyTorch" in env["not_found"]["cuda_devices"]


def test_nvidia_smi_missing_or_hung_never_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert topology._nvidia_smi("-q") is None
    _fake_smi(tmp_path / "bin", "while :; do :; done\n")  # hangs, as a wedged driver can
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    started = time.monotonic()
    assert topology._nvidia_smi("-q", timeout_s=0.2) is None
    assert time.monotonic() - started < 5
