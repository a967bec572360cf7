"""InfiniBand adapters on a fake /sys, and which ports NCCL_IB_HCA selects."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.host.infiniband import infiniband_devices, nccl_ib_selection
from tests.host.fake_trees import hardware_tree


def test_fake_infiniband_device_reports_each_port_and_its_netdev(tmp_path: Path) -> None:
    sys_root, _ = hardware_tree(tmp_path)
    (dev,) = infiniband_devices(sys_root)
    assert (dev["name"], dev["fw_ver"], dev["netdevs"]) == ("mlx5_0", "28.39.1002", ["ib0"])
    assert [(p["port"], p["state"], p["rate"], p["link_layer"]) for p in dev["ports"]] == [
        (1, "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand"),
        (2, "1: DOWN", "200 Gb/sec (4X HDR)", "InfiniBand"),
    ]
    assert infiniband_devices(tmp_path / "nothing") == []


@pytest.mark.parametrize(("spec", "ports", "problem"), [
    (None, ["mlx5_0:1", "mlx5_0:2"], None),           # unset: NCCL takes every port
    ("mlx5", ["mlx5_0:1", "mlx5_0:2"], None),         # a prefix
    ("=mlx5_0:1", ["mlx5_0:1"], None),                # exact name and port
    ("^mlx5_0:2", ["mlx5_0:1"], None),                # exclude one port
    ("mlx5_1", [], "names 'mlx5_1', but no such HCA"),  # a typo, or the wrong node's list
    ("=mlx5", [], "names 'mlx5', but no such HCA"),   # exact: a prefix does not match
])
def test_nccl_ib_hca_selects_ports_and_names_missing_hcas(tmp_path: Path, spec: str | None,
                                                          ports: list[str], problem: str | None) -> None:
    sys_root, _ = hardware_tree(tmp_path)
    got = nccl_ib_selection(spec, infiniband_devices(sys_root))
    assert got["ports"] == ports
    if problem is None:
        assert got["problems"] == []
    else:
        assert any(problem in p for p in got["problems"]), got["problems"]
        assert any("NCCL_IB_HCA=" in p and "InfiniBand" in p for p in got["problems"]), got["problems"]
