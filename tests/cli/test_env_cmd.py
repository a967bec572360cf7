"""`dspark env`: the JSON keys, the table's rows for present and absent hardware, and the network
checks before a multi-node launch (--nnodes, --master-addr, Slurm's defaults)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.cli.env_cmd import network_rows, render_rows
from dspark.cli.main import main
from dspark.host import collect_environment, network_report
from tests.host.fake_trees import network_tree
from tests.messages import assert_line_names


def test_env_json_has_the_report_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert set(env) >= {"versions", "os", "cpu", "memory", "numa_nodes", "cuda_devices",
                        "nvidia_smi_gpus", "memory_coherence", "nvlink", "infiniband", "nccl_ib",
                        "network", "backends", "warnings", "not_found"}
    assert set(env["versions"]) >= {"dspark", "torch", "python", "torch_cuda", "torch_nccl"}
    assert set(env["cpu"]) >= {"model", "logical_cores", "usable_cores"}
    assert isinstance(env["cuda_devices"], list) and isinstance(env["infiniband"], list)
    for key in ("cuda_devices", "infiniband"):
        assert (key in env["not_found"]) == (env[key] == []), key


def test_env_table_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch" in out and "Backends" in out and "InfiniBand" in out
    assert "Network interfaces" in out and "gloo would use" in out and "GLOO_SOCKET_IFNAME" in out


def test_table_rows_say_not_found_for_absent_hardware(tmp_path: object) -> None:
    env = collect_environment(sys_root=str(tmp_path), proc_root=str(tmp_path), probe_gpus=False)
    rows = dict(render_rows(env))
    assert rows["InfiniBand"].startswith("not found")
    assert rows["CUDA devices"] == "not probed"
    assert rows["NUMA nodes"].startswith("not found")


def test_table_rows_show_present_hardware(tmp_path: object) -> None:
    env = collect_environment(sys_root=str(tmp_path), proc_root=str(tmp_path), probe_gpus=False)
    env["cuda_devices"] = [{"index": 0, "name": "NVIDIA GB10", "total_memory_bytes": 128 * 2**30,
                            "compute_capability": "12.1", "multiprocessors": 48, "is_integrated": True}]
    env["memory_coherence"] = {"coherent": True, "kind": "integrated GPU (one shared memory)",
                               "evidence": ["cuda:0 is_integrated=True"]}
    env["nvlink"] = {"per_gpu": [], "pairs": [{"gpus": [0, 1], "links": 18}]}
    env["not_found"].pop("nvlink", None)
    env["infiniband"] = [{"name": "mlx5_0", "fw_ver": "1", "ports": [
        {"port": 1, "state": "4: ACTIVE", "phys_state": "5: LinkUp", "rate": "200 Gb/sec (4X HDR)",
         "link_layer": "InfiniBand"}], "netdevs": ["ib0"]}]
    env["nccl_ib"] = {"spec": None, "ports": ["mlx5_0:1"], "problems": []}
    rows = dict(render_rows(env))
    assert "NVIDIA GB10" in rows["CUDA devices"] and "integrated" in rows["CUDA devices"]
    assert rows["Coherent CPU-GPU memory"].startswith("yes")
    assert rows["NVLink"] == "GPU0 <-> GPU1: NV18"
    assert rows["InfiniBand"] == "mlx5_0 port 1: 4: ACTIVE, 200 Gb/sec (4X HDR), InfiniBand (netdev ib0)"
    assert rows["NCCL IB ports"] == "mlx5_0:1"


def test_network_rows_show_interfaces_choices_and_the_warning(tmp_path: Path) -> None:
    sys_root, proc_root = network_tree(tmp_path)
    env = collect_environment(sys_root=sys_root, proc_root=proc_root, probe_gpus=False,
                              environ={"NCCL_SOCKET_IFNAME": "eth"}, nnodes=2, master_addr="node0",
                              hostname="n0", resolve={"n0": ["127.0.1.1"], "node0": ["10.1.2.9"]}.get)
    rows = render_rows(env)
    table = dict(rows)
    assert table["Hostname"] == "n0 -> 127.0.1.1"
    lines = table["Network interfaces"].splitlines()
    assert lines[0] == "lo (loopback, up, mtu 65536): 127.0.0.1/8, ::1/128"
    assert lines[1] == "eth0 (up, mtu 1500, 25000 Mb/s): 10.1.2.5/24, fe80::5/64, fd00::5/64"
    assert_line_names("\n".join(lines), "eth1", "down", "mtu 1500", "no address")
    assert table["Other IPv4 addresses"].startswith("100.64.0.9")
    assert table["Route to master"] == "node0 -> 10.1.2.9 directly connected on eth0"
    assert (table["NCCL_SOCKET_IFNAME"], table["GLOO_SOCKET_IFNAME"]) == ("eth", "unset")
    assert table["gloo would use"].startswith("lo 127.0.1.1 (LOOPBACK): GLOO_SOCKET_IFNAME unset")
    assert table["NCCL would use"] == "eth0 10.1.2.5: NCCL_SOCKET_IFNAME=eth"
    warnings = [value for field, value in rows if field == "WARNING"]
    assert len(warnings) == 1 and "Set GLOO_SOCKET_IFNAME=eth0" in warnings[0]
    by_address = network_report(sys_root=sys_root, proc_root=proc_root, environ={}, master_addr="10.1.2.9",
                                hostname="n0", resolve=lambda host: [host] if host[0].isdigit() else [])
    assert dict(network_rows(by_address))["Route to master"] == "10.1.2.9 directly connected on eth0"


def test_env_checks_the_master_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json", "--nnodes", "2", "--master-addr", "127.0.0.1"]) == 0
    net = json.loads(capsys.readouterr().out)["network"]
    assert net["nnodes"] == 2 and net["master"]["reach"] == "loopback"
    assert any("is loopback (127.0.0.1)" in w for w in net["warnings"])


def test_env_takes_nodes_and_master_from_slurm(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost,gpu2")
    assert main(["env", "--json"]) == 0
    net = json.loads(capsys.readouterr().out)["network"]
    assert (net["nnodes"], net["master"]["master_addr"]) == (2, "localhost")
    assert main(["env", "--json", "--nnodes", "1"]) == 0  # given: Slurm's count is not used
    net = json.loads(capsys.readouterr().out)["network"]
    assert (net["nnodes"], net["master"]) == (1, None)
