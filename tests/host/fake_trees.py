"""Fake ``/sys`` and ``/proc`` trees for the host probes: what a two-socket GPU node with an
InfiniBand adapter, a LAN interface, IPoIB and docker would show."""

from __future__ import annotations

from pathlib import Path

# A node with lo, eth0 (10.1.2.5/24, default route via 10.1.2.1), ib0 (IPoIB, 192.168.50.5/24),
# docker0 (172.17.0.1/16), and a /32 on tun0 that no subnet route claims.
FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 10.1.2.0/24 2 0 2
        |-- 10.1.2.0
           /24 link UNICAST
        |-- 10.1.2.5
           /32 host LOCAL
Local:
  +-- 0.0.0.0/0 3 0 5
     +-- 10.1.2.0/24 2 0 2
        |-- 10.1.2.5
           /32 host LOCAL
        |-- 10.1.2.255
           /32 link BROADCAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /32 link BROADCAST
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
     |-- 172.17.0.1
        /32 host LOCAL
     |-- 192.168.50.5
        /32 host LOCAL
     |-- 100.64.0.9
        /32 host LOCAL
"""
IF_INET6 = (
    "00000000000000000000000000000001 01 80 10 80       lo\n"
    "fe800000000000000000000000000005 02 40 20 80     eth0\n"
    "fd000000000000000000000000000005 02 40 00 80     eth0\n"
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _hex(address: str) -> str:
    parts = [int(p) for p in address.split(".")]
    return "".join(f"{p:02X}" for p in reversed(parts))


def route_line(iface: str, dest: str, gateway: str, mask: str, *, flags: int, metric: int = 0) -> str:
    """One ``/proc/net/route`` row, in the kernel's little-endian hex."""
    return (f"{iface}\t{_hex(dest)}\t{_hex(gateway)}\t{flags:04X}\t0\t0\t{metric}\t{_hex(mask)}"
            f"\t0\t0\t0\n")


ROUTE_HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
ROUTES = ROUTE_HEADER + "".join([
    route_line("eth0", "0.0.0.0", "10.1.2.1", "0.0.0.0", flags=0x3, metric=100),
    route_line("eth0", "10.1.2.0", "0.0.0.0", "255.255.255.0", flags=0x1),
    route_line("ib0", "192.168.50.0", "0.0.0.0", "255.255.255.0", flags=0x1),
    route_line("ib0", "10.8.0.0", "192.168.50.1", "255.255.0.0", flags=0x3),
    route_line("docker0", "172.17.0.0", "0.0.0.0", "255.255.0.0", flags=0x1),
    route_line("eth1", "10.9.0.0", "0.0.0.0", "255.255.0.0", flags=0x0),  # a route that is down
])

# name: (ifindex, flags, operstate, mtu, speed)
INTERFACES = {
    "lo": (1, "0x9", "unknown", 65536, None),
    "eth0": (2, "0x1003", "up", 1500, "25000"),
    "ib0": (3, "0x1003", "up", 2044, "200000"),
    "docker0": (4, "0x1003", "down", 1500, "-1"),
    "tun0": (5, "0x1091", "unknown", 1400, None),
    "eth1": (6, "0x1002", "down", 1500, None),
}


def network_tree(root: Path) -> tuple[Path, Path]:
    """``(sys_root, proc_root)`` with the interfaces, routes and addresses above."""
    sys_root, proc_root = root / "sys", root / "proc"
    for name, (index, flags, operstate, mtu, speed) in INTERFACES.items():
        base = sys_root / "class/net" / name
        write(base / "ifindex", f"{index}\n")
        write(base / "flags", f"{flags}\n")
        write(base / "operstate", f"{operstate}\n")
        write(base / "mtu", f"{mtu}\n")
        if speed is not None:
            write(base / "speed", f"{speed}\n")
    write(proc_root / "net/fib_trie", FIB_TRIE)
    write(proc_root / "net/route", ROUTES)
    write(proc_root / "net/if_inet6", IF_INET6)
    return sys_root, proc_root


def hardware_tree(root: Path) -> tuple[Path, Path]:
    """``(sys_root, proc_root)`` with two NUMA nodes, one two-port InfiniBand adapter carrying
    ib0, a meminfo and a cpuinfo."""
    sys_root, proc_root = root / "sys", root / "proc"
    for node, cpus, kib in ((0, "0-3", 1024), (1, "4-7", 2048)):
        write(sys_root / f"devices/system/node/node{node}/cpulist", f"{cpus}\n")
        write(sys_root / f"devices/system/node/node{node}/meminfo",
              f"Node {node} MemTotal:       {kib} kB\nNode {node} MemFree:  1 kB\n")
    write(sys_root / "devices/system/node/online", "0-1\n")  # not a node directory
    ib = sys_root / "class/infiniband/mlx5_0"
    write(ib / "fw_ver", "28.39.1002\n")
    write(ib / "device/net/ib0/ifindex", "3\n")
    for port, state in ((1, "4: ACTIVE"), (2, "1: DOWN")):
        write(ib / f"ports/{port}/state", state + "\n")
        write(ib / f"ports/{port}/rate", "200 Gb/sec (4X HDR)\n")
        write(ib / f"ports/{port}/link_layer", "InfiniBand\n")
    write(proc_root / "meminfo", "MemTotal:       8000 kB\nMemFree: 10 kB\nMemAvailable:   6000 kB\n")
    write(proc_root / "cpuinfo", "processor\t: 0\nmodel name\t: Fake CPU 9000\n")
    return sys_root, proc_root
