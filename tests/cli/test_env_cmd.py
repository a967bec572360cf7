"""`dspark env`: the JSON keys, and the table's rows for present and absent hardware."""

from __future__ import annotations

import json

import pytest

from dspark.cli.env_cmd import render_rows
from dspark.cli.main import main
from dspark.comm.topology import collect_environment


def test_env_json_has_the_report_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert set(env) >= {"versions", "os", "cpu", "memory", "numa_nodes", "cuda_devices",
                        "nvidia_smi_gpus", "memory_coherence", "nvlink", "infiniband", "backends",
                        "not_found"}
    assert set(env["versions"]) >= {"dspark", "torch", "python", "torch_cuda", "torch_nccl"}
    assert set(env["cpu"]) >= {"model", "logical_cores", "usable_cores"}
    assert isinstance(env["cuda_devices"], list) and isinstance(env["infiniband"], list)
    for key in ("cuda_devices", "infiniband"):
        assert (key in env["not_found"]) == (env[key] == []), key


def test_env_table_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch" in out and "Backends" in out and "InfiniBand" in out


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
         "link_layer": "InfiniBand"}]}]
    rows = dict(render_rows(env))
    assert "NVIDIA GB10" in rows["CUDA devices"] and "integrated" in rows["CUDA devices"]
    assert rows["Coherent CPU-GPU memory"].startswith("yes")
    assert rows["NVLink"] == "GPU0 <-> GPU1: NV18"
    assert rows["InfiniBand"] == "mlx5_0 port 1: 4: ACTIVE, 200 Gb/sec (4X HDR), InfiniBand"
