"""CPU, memory and NUMA probes on a fake /sys and /proc."""

from __future__ import annotations

import os
from pathlib import Path

from dspark.host.cpu_memory import cpu_info, memory_info, numa_nodes
from tests.host.fake_trees import hardware_tree


def test_fake_numa_nodes_are_read_in_order(tmp_path: Path) -> None:
    sys_root, _ = hardware_tree(tmp_path)
    assert numa_nodes(sys_root) == [
        {"id": 0, "cpus": "0-3", "memory_total_bytes": 1024 * 1024},
        {"id": 1, "cpus": "4-7", "memory_total_bytes": 2048 * 1024},
    ]


def test_fake_proc_memory_and_cpu_model(tmp_path: Path) -> None:
    _, proc_root = hardware_tree(tmp_path)
    assert memory_info(proc_root) == {"total_bytes": 8000 * 1024, "available_bytes": 6000 * 1024}
    cpu = cpu_info(proc_root)
    assert cpu["model"] == "Fake CPU 9000"
    assert cpu["usable_cores"] == len(os.sched_getaffinity(0))


def test_absent_files_are_none_not_guessed(tmp_path: Path) -> None:
    assert memory_info(tmp_path) == {"total_bytes": None, "available_bytes": None}
    assert cpu_info(tmp_path)["model"] is None
    assert numa_nodes(tmp_path) == []
