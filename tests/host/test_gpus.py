"""GPU probes: canned nvidia-smi output, a fake nvidia-smi on PATH, and the coherence evidence."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from dspark.host import environment, gpus
from dspark.host.environment import collect_environment
from dspark.host.gpus import (
    memory_coherence,
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
SMI_QUERY = ("GPU 00000009:01:00.0\n    Product Name : NVIDIA GH200 480GB\n"
             "    Addressing Mode                       : ATS\n")


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
    monkeypatch.setattr(environment, "cuda_devices", lambda: [])  # as a CPU-only PyTorch build sees it
    env = collect_environment(sys_root=tmp_path, proc_root=tmp_path, hostname="n0", resolve=lambda _: [])
    assert [g["index"] for g in env["nvidia_smi_gpus"]] == [0, 1]
    assert env["nvlink"]["pairs"][0] == {"gpus": [0, 1], "links": 18}
    assert env["nvlink"]["per_gpu"] == []  # `nvlink --status` failed: reported empty, not invented
    assert "CPU-only PyTorch" in env["not_found"]["cuda_devices"]


def test_nvidia_smi_missing_or_hung_never_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert gpus.nvidia_smi("-q") is None
    _fake_smi(tmp_path / "bin", "while :; do :; done\n")  # hangs, as a wedged driver can
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    started = time.monotonic()
    assert gpus.nvidia_smi("-q", timeout_s=0.2) is None
    assert time.monotonic() - started < 5
