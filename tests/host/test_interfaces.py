"""Interfaces, addresses and routes read from a fake /sys/class/net and /proc/net."""

from __future__ import annotations

from pathlib import Path

from dspark.host.interfaces import (
    Route,
    interfaces,
    ipv4_routes,
    local_ipv4_addresses,
    unattributed_ipv4,
)
from tests.host.fake_trees import network_tree


def test_interfaces_carry_state_and_their_own_addresses(tmp_path: Path) -> None:
    sys_root, proc_root = network_tree(tmp_path)
    found = {i.name: i for i in interfaces(sys_root, proc_root)}
    assert list(found) == ["lo", "eth0", "ib0", "docker0", "tun0", "eth1"]  # kernel index order
    lo, eth0, ib0, docker0 = found["lo"], found["eth0"], found["ib0"], found["docker0"]
    assert (lo.is_loopback, lo.ipv4, lo.ipv6, lo.speed_mbps) == (True, ("127.0.0.1/8",), ("::1/128",), None)
    assert (eth0.is_loopback, eth0.is_up, eth0.operstate, eth0.mtu, eth0.speed_mbps) == (
        False, True, "up", 1500, 25000)
    assert eth0.ipv4 == ("10.1.2.5/24",) and eth0.ipv6 == ("fe80::5/64", "fd00::5/64")
    assert eth0.peer_addresses == ("10.1.2.5", "fd00::5")  # link-local is no address for a peer
    assert ib0.ipv4 == ("192.168.50.5/24",) and ib0.speed_mbps == 200000
    # administratively up with no carrier; "-1" speed means the driver does not know
    assert (docker0.ipv4, docker0.is_up, docker0.operstate, docker0.speed_mbps) == (
        ("172.17.0.1/16",), True, "down", None)
    assert found["eth1"].is_up is False and found["eth1"].peer_addresses == ()
    assert found["tun0"].ipv4 == ()  # its /32 is in no subnet route: not pinned on it by guess


def test_local_addresses_and_the_unattributed_one(tmp_path: Path) -> None:
    sys_root, proc_root = network_tree(tmp_path)
    assert local_ipv4_addresses(proc_root) == ["10.1.2.5", "100.64.0.9", "127.0.0.1", "172.17.0.1",
                                               "192.168.50.5"]
    assert unattributed_ipv4(interfaces(sys_root, proc_root), proc_root) == ["100.64.0.9"]


def test_routes_decode_little_endian_hex_and_skip_routes_that_are_down(tmp_path: Path) -> None:
    _, proc_root = network_tree(tmp_path)
    routes = ipv4_routes(proc_root)
    assert routes[0] == Route(interface="eth0", destination="0.0.0.0", prefix_len=0,
                              gateway="10.1.2.1", metric=100)
    assert [(r.interface, r.destination, r.prefix_len, r.gateway) for r in routes[1:]] == [
        ("eth0", "10.1.2.0", 24, None), ("ib0", "192.168.50.0", 24, None),
        ("ib0", "10.8.0.0", 16, "192.168.50.1"), ("docker0", "172.17.0.0", 16, None)]
    assert routes[3].contains("10.8.200.1") and not routes[3].contains("10.9.0.1")


def test_absent_trees_give_nothing(tmp_path: Path) -> None:
    assert interfaces(tmp_path, tmp_path) == []
    assert ipv4_routes(tmp_path) == [] and local_ipv4_addresses(tmp_path) == []
