"""InfiniBand / RoCE adapters (HCAs) from ``/sys/class/infiniband``, and which of them
``NCCL_IB_HCA`` selects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.host._files import read_text
from dspark.host.nccl_lists import parse_nccl_list

__all__ = ["infiniband_devices", "nccl_ib_selection"]


def _port_number(path: Path) -> int:
    return int(path.name) if path.name.isdigit() else 0


def infiniband_devices(sys_root: str | Path = "/sys") -> list[dict[str, Any]]:
    """InfiniBand / RoCE adapters: name, firmware, the network interfaces they carry (``ib0`` for
    IPoIB, the Ethernet port for RoCE) and each port's state, rate and link layer; ``[]`` when
    there are none.

    Example::

        infiniband_devices()
        # [{'name': 'mlx5_0', 'fw_ver': '28.39.1002', 'netdevs': ['ib0'],
        #   'ports': [{'port': 1, 'state': '4: ACTIVE', 'rate': '200 Gb/sec (4X HDR)', ...}]}]
    """
    base = Path(sys_root) / "class/infiniband"
    devices = []
    for dev in sorted(base.iterdir() if base.is_dir() else []):
        ports = []
        port_dirs = (dev / "ports").iterdir() if (dev / "ports").is_dir() else iter(())
        for port in sorted(port_dirs, key=_port_number):
            ports.append({"port": int(port.name) if port.name.isdigit() else port.name,
                          "state": read_text(port / "state"),
                          "phys_state": read_text(port / "phys_state"),
                          "rate": read_text(port / "rate"),
                          "link_layer": read_text(port / "link_layer")})
        net = dev / "device/net"
        netdevs = sorted(p.name for p in net.iterdir()) if net.is_dir() else []
        devices.append({"name": dev.name, "fw_ver": read_text(dev / "fw_ver"), "netdevs": netdevs,
                        "ports": ports})
    return devices


def nccl_ib_selection(spec: str | None, devices: list[dict[str, Any]]) -> dict[str, Any]:
    """The HCA ports NCCL would use under ``NCCL_IB_HCA=spec`` (every port when unset), and the
    problems: an entry that names no HCA found here.

    Example::

        nccl_ib_selection("mlx5_1", infiniband_devices())
        # {'spec': 'mlx5_1', 'ports': [], 'problems': ["NCCL_IB_HCA='mlx5_1' selects no HCA ..."]}
    """
    wanted = parse_nccl_list(spec) if spec else None
    chosen = [f"{dev['name']}:{port['port']}" for dev in devices for port in dev["ports"]
              if wanted is None or wanted.selects(dev["name"], port["port"])]
    problems = []
    if wanted is not None and not wanted.exclude:
        names = [dev["name"] for dev in devices]
        for name, _ in wanted.entries:
            if not any(n == name if wanted.exact else n.startswith(name) for n in names):
                problems.append(f"NCCL_IB_HCA={spec!r} names {name!r}, but no such HCA is in "
                                f"/sys/class/infiniband (found: {', '.join(names) or 'none'})")
    if wanted is not None and not chosen and devices:
        problems.append(f"NCCL_IB_HCA={spec!r} selects no HCA port of the ones found "
                        f"({', '.join(dev['name'] for dev in devices)}): NCCL will not use InfiniBand")
    return {"spec": spec, "ports": chosen, "problems": problems}
