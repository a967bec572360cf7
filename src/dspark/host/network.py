"""Which network interface the ranks would use, and whether other nodes could reach it.

What ``dspark env`` checks on a node before a multi-node launch, computed from the interfaces
(:mod:`dspark.host.interfaces`), the environment and name resolution, without starting a process
group:

* **gloo** binds each rank to the interfaces named in ``GLOO_SOCKET_IFNAME`` (comma-separated).
  Without it, gloo resolves this host's name and binds the first address that belongs to this
  host; if none does, it falls back to loopback. Either way a hostname that resolves to
  ``127.0.x.1`` (the Debian ``/etc/hosts`` default, and common in containers) means loopback.
* **NCCL** takes the interfaces ``NCCL_SOCKET_IFNAME`` selects (:mod:`dspark.host.nccl_lists`).
  Without it: ``ib*`` interfaces first, then any but ``lo`` and ``docker*``, then ``docker*``,
  and loopback only when nothing else has an address.
* the **master** (``--master-addr``) is resolved, and the IPv4 routing table says which interface
  traffic to it leaves through: the one to name in ``*_SOCKET_IFNAME`` when the default is wrong.

A rank bound to loopback is reachable from its own node only: fine for ``nnodes=1``, a hang at the
first collective for ``nnodes > 1``. That case is a warning with the fix.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dspark.host.interfaces import Interface, Route, interfaces, ipv4_routes, unattributed_ipv4
from dspark.host.nccl_lists import parse_nccl_list

__all__ = [
    "SOCKET_ENV_VARS",
    "MasterReach",
    "MasterRoute",
    "SocketChoice",
    "gloo_choice",
    "nccl_choice",
    "network_report",
    "network_warnings",
    "resolve_host",
    "route_to_master",
]

SOCKET_ENV_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE")
"""The variables that decide which network the ranks use (reported as set or unset)."""

LOOPBACK_FALLBACK = "127.0.0.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class SocketChoice:
    """The interfaces one library (gloo or NCCL) would bind, and why."""

    library: str
    interfaces: tuple[str, ...]
    address: str | None
    """The address peers would connect to (the first chosen interface's)."""
    is_loopback: bool
    why: str
    problems: tuple[str, ...] = ()
    """What is wrong with the setting (an interface that does not exist, has no address...)."""


MasterReach = Literal["loopback", "this node", "routed", "unresolved", "no route", "undetermined"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MasterRoute:
    """How this node reaches the master address (node 0's host)."""

    master_addr: str
    addresses: tuple[str, ...]
    """What ``master_addr`` resolves to (empty: it does not resolve)."""
    reach: MasterReach
    """``this node``: the address is one of ours (this is node 0); ``undetermined``: IPv6."""
    interface: str | None
    """The interface traffic to the master leaves through; ``None`` when not determined."""
    gateway: str | None
    how: str


def resolve_host(host: str) -> list[str]:
    """The addresses ``host`` resolves to, in resolver order, each once (``[]`` if it does not).

    Example::

        resolve_host("localhost")   # ['127.0.0.1', '::1']
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _owner(address: str, ifaces: list[Interface]) -> Interface | None:
    for iface in ifaces:
        if address in iface.peer_addresses:
            return iface
    if _is_loopback(address):
        return next((i for i in ifaces if i.is_loopback), None)
    return None


def gloo_choice(environ: Mapping[str, str], ifaces: list[Interface], *, hostname: str,
                hostname_addresses: list[str]) -> SocketChoice:
    """The interfaces gloo would bind on this node (see the module's docstring for its rule).

    Example::

        gloo_choice({}, interfaces(), hostname="vm", hostname_addresses=["127.0.0.1"]).is_loopback
        # True: 'vm' resolves to loopback, so gloo binds 127.0.0.1
    """
    by_name = {i.name: i for i in ifaces}
    named = environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if named:
        wanted = [n.strip() for n in named.split(",") if n.strip()]
        problems = []
        for name in wanted:
            iface = by_name.get(name)
            if iface is None:
                problems.append(f"GLOO_SOCKET_IFNAME={named!r} names {name!r}, which is not an "
                                f"interface of this host (have: {', '.join(by_name) or 'none'})")
            elif not iface.peer_addresses:
                problems.append(f"GLOO_SOCKET_IFNAME={named!r}: interface {name!r} has no address")
            elif not iface.is_up:
                problems.append(f"GLOO_SOCKET_IFNAME={named!r}: interface {name!r} is down")
        first = by_name.get(wanted[0]) if wanted else None
        address = first.peer_addresses[0] if first and first.peer_addresses else None
        return SocketChoice(library="gloo", interfaces=tuple(wanted), address=address,
                            is_loopback=bool(first and first.is_loopback),
                            why=f"GLOO_SOCKET_IFNAME={named}", problems=tuple(problems))
    for address in hostname_addresses:
        iface = _owner(address, ifaces)
        if iface is not None or _is_loopback(address):  # 127.0.1.1 binds even if no /32 lists it
            return SocketChoice(library="gloo", interfaces=(iface.name,) if iface else (),
                                address=address, is_loopback=_is_loopback(address),
                                why=f"GLOO_SOCKET_IFNAME unset: hostname {hostname!r} resolves to {address}")
    loopback = next((i.name for i in ifaces if i.is_loopback), None)
    said = ", ".join(hostname_addresses) if hostname_addresses else "nothing"
    return SocketChoice(library="gloo", interfaces=(loopback,) if loopback else (),
                        address=LOOPBACK_FALLBACK, is_loopback=True,
                        why=f"GLOO_SOCKET_IFNAME unset and hostname {hostname!r} resolves to {said}, "
                            f"not to an address of this host: gloo falls back to loopback")


def nccl_choice(environ: Mapping[str, str], ifaces: list[Interface]) -> SocketChoice:
    """The interfaces NCCL's socket transport and bootstrap would use (the first one bootstraps).

    Example::

        nccl_choice({"NCCL_SOCKET_IFNAME": "^lo"}, interfaces()).interfaces   # ('eth0',)
    """
    usable = [i for i in ifaces if i.peer_addresses]
    spec = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    problems: tuple[str, ...] = ()
    if spec:
        wanted = parse_nccl_list(spec)
        chosen = [i for i in usable if wanted.selects(i.name)]
        why = f"NCCL_SOCKET_IFNAME={spec}"
        if not chosen:
            problems = (f"NCCL_SOCKET_IFNAME={spec!r} selects none of the interfaces with an address "
                        f"({', '.join(i.name for i in usable) or 'none'}): NCCL will fail to start",)
    else:
        tiers = ([i for i in usable if i.name.startswith("ib")],
                 [i for i in usable if not i.is_loopback and not i.name.startswith(("ib", "docker"))],
                 [i for i in usable if i.name.startswith("docker")],
                 [i for i in usable if i.is_loopback])
        chosen = next((tier for tier in tiers if tier), [])
        why = "NCCL_SOCKET_IFNAME unset: NCCL takes ib* first, then any interface but lo and docker*"
    first = chosen[0] if chosen else None
    return SocketChoice(library="nccl", interfaces=tuple(i.name for i in chosen),
                        address=first.peer_addresses[0] if first else None,
                        is_loopback=bool(first and first.is_loopback), why=why, problems=problems)


def route_to_master(master_addr: str, addresses: list[str], ifaces: list[Interface],
                    routes: list[Route]) -> MasterRoute:
    """The interface this node reaches ``master_addr`` through (longest IPv4 prefix, then metric).

    Example::

        route_to_master("10.0.0.1", ["10.0.0.1"], interfaces(), ipv4_routes()).interface   # 'eth0'
    """
    def said(reach: MasterReach, how: str, interface: str | None = None,
             gateway: str | None = None) -> MasterRoute:
        return MasterRoute(master_addr=master_addr, addresses=tuple(addresses), reach=reach,
                           interface=interface, gateway=gateway, how=how)

    if not addresses:
        return said("unresolved", f"{master_addr!r} does not resolve on this node")
    address = addresses[0]
    own = _owner(address, ifaces)
    if _is_loopback(address):
        return said("loopback", f"{address} is loopback", own.name if own else None)
    if own is not None:
        return said("this node", f"{address} is this node's own address (this is node 0)", own.name)
    if ipaddress.ip_address(address).version != 4:
        return said("undetermined", f"{address} is IPv6: check the route with `ip route get {address}`")
    matches = [r for r in routes if r.contains(address)]
    if not matches:
        return said("no route", f"no route to {address} in the IPv4 routing table")
    best = max(matches, key=lambda r: (r.prefix_len, -r.metric))
    hop = f"via gateway {best.gateway}" if best.gateway else "directly connected"
    return said("routed", f"{address} {hop} on {best.interface}", best.interface, best.gateway)


def _suggested_interface(ifaces: list[Interface], master: MasterRoute | None) -> tuple[str, str]:
    """The interface to name in ``*_SOCKET_IFNAME`` instead of loopback, and why that one."""
    if master is not None and master.reach in ("routed", "this node") and master.interface:
        return master.interface, "the interface that routes to the master"
    routable = [i.name for i in ifaces
                if not i.is_loopback and i.is_up and i.ipv4 and not i.name.startswith("docker")]
    if len(routable) == 1:
        return routable[0], "this node's only routable interface"
    if routable:
        return routable[0], f"this node's first routable interface; it also has {', '.join(routable[1:])}"
    return "<interface>", "no routable interface with an IPv4 address was found on this node"


def network_warnings(*, gloo: SocketChoice, nccl: SocketChoice, master: MasterRoute | None,
                     nnodes: int, ifaces: list[Interface]) -> list[str]:
    """What would break a launch of ``nnodes`` nodes, each with its fix. Giving a master address
    that is not loopback counts as a multi-node launch.

    Example::

        network_warnings(gloo=gloo, nccl=nccl, master=None, nnodes=2, ifaces=ifaces)
        # ["gloo would bind loopback (127.0.0.1 ...): ... Set GLOO_SOCKET_IFNAME=eth0 ..."]
    """
    warnings = [*gloo.problems, *nccl.problems]
    multi_node = nnodes > 1 or (master is not None and master.reach not in ("loopback", "unresolved"))
    if multi_node:
        name, reason = _suggested_interface(ifaces, master)
        for choice, var in ((gloo, "GLOO_SOCKET_IFNAME"), (nccl, "NCCL_SOCKET_IFNAME")):
            if choice.is_loopback:
                label = "gloo" if choice.library == "gloo" else "NCCL (GPU jobs)"
                warnings.append(f"{label} would bind loopback ({choice.address}; {choice.why}), which "
                                f"other nodes cannot reach: a job of nnodes={nnodes} would hang at its "
                                f"first collective. Set {var}={name} ({reason}).")
    if master is None:
        return warnings
    if master.reach in ("unresolved", "no route"):
        warnings.append(f"master {master.master_addr!r}: {master.how}; every node must reach it")
    elif master.reach == "loopback" and nnodes > 1:
        warnings.append(f"master {master.master_addr!r} is loopback ({master.addresses[0]}): nodes "
                        f"other than this one cannot reach it; pass node 0's routable address")
    elif (master.reach == "routed" and not gloo.is_loopback and gloo.interfaces
          and master.interface not in gloo.interfaces):
        warnings.append(f"gloo binds {', '.join(gloo.interfaces)} but traffic to the master leaves "
                        f"through {master.interface}: check that the other nodes can reach "
                        f"{gloo.address}, or set GLOO_SOCKET_IFNAME={master.interface}")
    return warnings


def network_report(*, sys_root: str | Path = "/sys", proc_root: str | Path = "/proc",
                   environ: Mapping[str, str], nnodes: int = 1, master_addr: str | None = None,
                   hostname: str | None = None,
                   resolve: Callable[[str], list[str]] = resolve_host) -> dict[str, Any]:
    """Everything ``dspark env`` says about the network, as a JSON-ready dict.

    ``resolve`` and ``hostname`` are parameters so that tests need no DNS; ``nnodes`` and
    ``master_addr`` describe the launch being checked.

    Example::

        report = network_report(environ=os.environ, nnodes=2, master_addr="node0")
        report["gloo"]["interfaces"], report["master"]["interface"], report["warnings"]
    """
    ifaces = interfaces(sys_root, proc_root)
    host = socket.gethostname() if hostname is None else hostname
    host_addresses = resolve(host)
    gloo = gloo_choice(environ, ifaces, hostname=host, hostname_addresses=host_addresses)
    nccl = nccl_choice(environ, ifaces)
    master = (None if master_addr is None else
              route_to_master(master_addr, resolve(master_addr), ifaces, ipv4_routes(proc_root)))
    return {
        "hostname": host,
        "hostname_addresses": host_addresses,
        "interfaces": [asdict(i) for i in ifaces],
        "unattributed_ipv4": unattributed_ipv4(ifaces, proc_root),
        "socket_env": {name: environ.get(name) for name in SOCKET_ENV_VARS},
        "nnodes": nnodes,
        "master": None if master is None else asdict(master),
        "gloo": asdict(gloo),
        "nccl": asdict(nccl),
        "warnings": network_warnings(gloo=gloo, nccl=nccl, master=master, nnodes=nnodes, ifaces=ifaces),
    }
