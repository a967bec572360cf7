"""Which interface gloo and NCCL would use, the route to the master, and the warnings, on a fake
node (see fake_trees.py: lo, eth0 10.1.2.5/24 with the default route, ib0 192.168.50.5/24 routing
10.8.0.0/16, docker0, an address-less eth1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.host.interfaces import Interface, interfaces, ipv4_routes
from dspark.host.network import (
    gloo_choice,
    nccl_choice,
    network_report,
    network_warnings,
    route_to_master,
)
from tests.host.fake_trees import network_tree
from tests.messages import assert_line_names


@pytest.fixture
def node(tmp_path: Path) -> tuple[Path, Path]:
    return network_tree(tmp_path)


@pytest.fixture
def ifaces(node: tuple[Path, Path]) -> list[Interface]:
    return interfaces(*node)


def _report(node: tuple[Path, Path], environ: dict[str, str], *, hostname_to: list[str],
            nnodes: int = 1, master_addr: str | None = None) -> dict:
    names = {"n0": hostname_to, "node0": ["10.1.2.9"], "far": ["10.8.3.4"], "localhost": ["127.0.0.1"]}
    report = network_report(sys_root=node[0], proc_root=node[1], environ=environ, nnodes=nnodes,
                             master_addr=master_addr, hostname="n0", resolve=lambda h: names.get(h, []))
    json.dumps(report)  # JSON-ready, as `dspark env --json` prints it
    return report


@pytest.mark.parametrize(("hostname_to", "interface", "address", "loopback", "why"), [
    (["127.0.1.1"], "lo", "127.0.1.1", True, "resolves to 127.0.1.1"),  # Debian's /etc/hosts default
    (["10.1.2.5"], "eth0", "10.1.2.5", False, "resolves to 10.1.2.5"),
    (["203.0.113.7", "10.1.2.5"], "eth0", "10.1.2.5", False, "resolves to 10.1.2.5"),  # first local one
    (["203.0.113.7"], "lo", "127.0.0.1", True, "falls back to loopback"),  # another host's address
    ([], "lo", "127.0.0.1", True, "resolves to nothing"),
])
def test_gloo_binds_what_the_hostname_resolves_to(ifaces: list[Interface], hostname_to: list[str],
                                                  interface: str, address: str, loopback: bool,
                                                  why: str) -> None:
    got = gloo_choice({}, ifaces, hostname="n0", hostname_addresses=hostname_to)
    assert (got.interfaces, got.address, got.is_loopback) == ((interface,), address, loopback)
    assert why in got.why and got.problems == ()


@pytest.mark.parametrize(("setting", "problem"), [
    ("ib0", None),
    ("eth0,ib0", None),
    ("eth9", "'eth9', which is not an interface of this host"),
    ("eth1", "interface 'eth1' has no address"),
])
def test_gloo_socket_ifname_wins_and_is_checked(ifaces: list[Interface], setting: str,
                                                problem: str | None) -> None:
    got = gloo_choice({"GLOO_SOCKET_IFNAME": setting}, ifaces, hostname="n0",
                      hostname_addresses=["127.0.1.1"])
    assert got.interfaces == tuple(setting.split(",")) and got.why == f"GLOO_SOCKET_IFNAME={setting}"
    assert got.is_loopback is False
    if problem is None:
        assert got.problems == () and got.address is not None
    else:
        assert len(got.problems) == 1 and problem in got.problems[0]


def test_nccl_default_order_ib_then_others_then_docker_then_loopback(ifaces: list[Interface]) -> None:
    def pick(*names: str) -> tuple[str, ...]:
        return nccl_choice({}, [i for i in ifaces if i.name in names]).interfaces

    assert pick("lo", "eth0", "ib0", "docker0") == ("ib0",)
    assert pick("lo", "eth0", "docker0", "eth1") == ("eth0",)  # eth1 has no address
    assert pick("lo", "docker0") == ("docker0",)
    only_lo = nccl_choice({}, [i for i in ifaces if i.name == "lo"])
    assert only_lo.interfaces == ("lo",) and only_lo.is_loopback


@pytest.mark.parametrize(("spec", "chosen"), [
    ("eth", ("eth0",)),            # eth1 matches but has no address
    ("^lo,docker,ib", ("eth0",)),
    ("=docker0", ("docker0",)),
    ("enp", ()),
])
def test_nccl_socket_ifname_selects(ifaces: list[Interface], spec: str, chosen: tuple[str, ...]) -> None:
    got = nccl_choice({"NCCL_SOCKET_IFNAME": spec}, ifaces)
    assert got.interfaces == chosen
    assert bool(got.problems) == (not chosen)


@pytest.mark.parametrize(("addresses", "reach", "interface", "gateway"), [
    (["10.1.2.9"], "routed", "eth0", None),             # same subnet
    (["10.8.3.4"], "routed", "ib0", "192.168.50.1"),    # longest prefix beats the default route
    (["8.8.8.8"], "routed", "eth0", "10.1.2.1"),        # the default route
    (["10.1.2.5"], "this node", "eth0", None),          # we are node 0
    (["127.0.0.1"], "loopback", "lo", None),
    ([], "unresolved", None, None),
    (["fd00::99"], "undetermined", None, None),
])
def test_route_to_master(node: tuple[Path, Path], ifaces: list[Interface], addresses: list[str],
                         reach: str, interface: str | None, gateway: str | None) -> None:
    got = route_to_master("master", addresses, ifaces, ipv4_routes(node[1]))
    assert (got.reach, got.interface, got.gateway) == (reach, interface, gateway)


def test_no_route_is_said(ifaces: list[Interface]) -> None:
    got = route_to_master("master", ["10.1.2.9"], ifaces, routes=[])
    assert got.reach == "no route" and "no route to 10.1.2.9" in got.how


def test_loopback_gloo_warns_only_for_several_nodes(node: tuple[Path, Path]) -> None:
    one = _report(node, {}, hostname_to=["127.0.1.1"])
    assert one["gloo"]["is_loopback"] and one["warnings"] == []  # one node: loopback is right
    two = _report(node, {}, hostname_to=["127.0.1.1"], nnodes=2, master_addr="far")
    (warning,) = two["warnings"]
    assert_line_names(warning, "gloo", "loopback", "(127.0.1.1")
    assert "nnodes=2 would hang" in warning
    assert_line_names(warning, "GLOO_SOCKET_IFNAME=ib0", "master")
    # a master address that is not loopback means several nodes even without --nnodes
    assert len(_report(node, {}, hostname_to=["127.0.1.1"], master_addr="node0")["warnings"]) == 1
    fixed = _report(node, {"GLOO_SOCKET_IFNAME": "ib0"}, hostname_to=["127.0.1.1"], nnodes=2,
                    master_addr="far")
    assert fixed["warnings"] == [] and fixed["master"]["interface"] == "ib0"


def test_warnings_without_a_master_suggest_a_routable_interface(node: tuple[Path, Path]) -> None:
    (warning,) = _report(node, {}, hostname_to=[], nnodes=2)["warnings"]
    assert_line_names(warning, "GLOO_SOCKET_IFNAME=eth0", "first routable", "ib0")


def test_master_problems_are_warnings(node: tuple[Path, Path], ifaces: list[Interface]) -> None:
    unresolved = _report(node, {}, hostname_to=["10.1.2.5"], nnodes=2, master_addr="nowhere")
    assert unresolved["warnings"] == ["master 'nowhere': 'nowhere' does not resolve on this node; "
                                      "every node must reach it"]
    loop = _report(node, {}, hostname_to=["10.1.2.5"], nnodes=2, master_addr="localhost")
    assert any("localhost" in w and "loopback (127.0.0.1)" in w for w in loop["warnings"]), loop["warnings"]
    # gloo on ib0 while the master is reached through eth0: said, with the variable to set
    mismatch = _report(node, {"GLOO_SOCKET_IFNAME": "ib0"}, hostname_to=["10.1.2.5"], nnodes=2,
                       master_addr="node0")
    assert mismatch["warnings"] == ["gloo binds ib0 but traffic to the master leaves through eth0: check "
                                    "that the other nodes can reach 192.168.50.5, or set "
                                    "GLOO_SOCKET_IFNAME=eth0"]


def test_nccl_on_loopback_warns_for_several_nodes(ifaces: list[Interface]) -> None:
    lo_only = [i for i in ifaces if i.is_loopback]
    gloo = gloo_choice({}, ifaces, hostname="n0", hostname_addresses=["10.1.2.5"])
    warnings = network_warnings(gloo=gloo, nccl=nccl_choice({}, lo_only), master=None, nnodes=2,
                                ifaces=ifaces)
    assert len(warnings) == 1, warnings
    assert_line_names(warnings[0], "NCCL", "loopback")
    assert "NCCL_SOCKET_IFNAME=eth0" in warnings[0]


def test_report_names_the_socket_variables(node: tuple[Path, Path]) -> None:
    got = _report(node, {"NCCL_IB_HCA": "mlx5_0", "GLOO_SOCKET_IFNAME": "eth0", "OTHER": "x"},
                  hostname_to=["10.1.2.5"])
    assert got["socket_env"] == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": None,
                                 "NCCL_IB_HCA": "mlx5_0", "NCCL_IB_DISABLE": None}
    assert got["unattributed_ipv4"] == ["100.64.0.9"] and got["hostname"] == "n0"
