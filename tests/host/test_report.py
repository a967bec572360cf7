"""`collect_environment`: the whole report on fake /sys and /proc trees, and on this machine."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dspark.host import collect_environment
from tests.host.fake_trees import hardware_tree, network_tree

REPORT_KEYS = {"versions", "os", "cpu", "memory", "numa_nodes", "cuda_devices", "nvidia_smi_gpus",
               "memory_coherence", "nvlink", "infiniband", "nccl_ib", "network", "backends",
               "warnings", "not_found"}


def _no_dns(_: str) -> list[str]:
    return []


def test_fake_node_report(tmp_path: Path) -> None:
    sys_root, proc_root = hardware_tree(tmp_path)
    network_tree(tmp_path)  # the same roots: /sys/class/net and /proc/net beside the rest
    env = collect_environment(sys_root=sys_root, proc_root=proc_root, probe_gpus=False,
                              environ={"NCCL_IB_HCA": "mlx5_9"}, hostname="n0", resolve=_no_dns)
    assert set(env) == REPORT_KEYS
    assert env["cpu"]["model"] == "Fake CPU 9000"
    assert len(env["numa_nodes"]) == 2 and env["infiniband"][0]["name"] == "mlx5_0"
    assert "infiniband" not in env["not_found"] and "numa_nodes" not in env["not_found"]
    assert [i["name"] for i in env["network"]["interfaces"]][:3] == ["lo", "eth0", "ib0"]
    # the report's warnings gather the network's and InfiniBand's: here, an HCA that is not there
    assert any("'mlx5_9'" in w and "HCA" in w for w in env["warnings"]), env["warnings"]


def test_absent_hardware_is_reported_absent_not_guessed(tmp_path: Path) -> None:
    env = collect_environment(sys_root=tmp_path / "sys", proc_root=tmp_path / "proc", probe_gpus=False,
                              environ={}, hostname="n0", resolve=_no_dns)
    assert env["infiniband"] == [] and env["numa_nodes"] == [] and env["cuda_devices"] == []
    assert env["network"]["interfaces"] == []
    assert env["memory"] == {"total_bytes": None, "available_bytes": None}
    assert env["cpu"]["model"] is None
    for key in ("infiniband", "numa_nodes", "memory", "cpu_model"):
        assert env["not_found"][key].startswith("not found"), key
    assert env["memory_coherence"]["coherent"] is None
    assert env["warnings"] == []  # one node, nothing set: nothing to warn about


def test_this_machine_reports_what_is_there() -> None:
    env = collect_environment()
    assert set(env) == REPORT_KEYS
    assert env["versions"]["torch"] == torch.__version__
    assert env["cpu"]["logical_cores"] == os.cpu_count()
    assert "gloo" in env["backends"]
    assert (env["cuda_devices"] == []) == (not torch.cuda.is_available())
    has_ib = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    assert bool(env["infiniband"]) == has_ib
    assert ("infiniband" in env["not_found"]) == (not has_ib)
    names = {i["name"] for i in env["network"]["interfaces"]}
    assert names == set(os.listdir("/sys/class/net"))
    assert any(i["is_loopback"] and "127.0.0.1/8" in i["ipv4"] for i in env["network"]["interfaces"])
