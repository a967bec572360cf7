"""Network interfaces, their addresses and the IPv4 routing table, read from ``/sys/class/net``
and ``/proc/net`` (both roots are parameters, so tests point them at fake trees).

IPv4 addresses are not in sysfs. The kernel lists this host's own addresses in
``/proc/net/fib_trie`` (entries marked ``/32 host LOCAL``), and ``/proc/net/route`` says which
interface carries the subnet each one belongs to; ``127.0.0.0/8`` is always the loopback's. An
address that no subnet route claims (a ``/32`` on a point-to-point link) is reported unattributed,
not pinned on a guessed interface. IPv6 addresses come per interface from ``/proc/net/if_inet6``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from dspark.host._files import read_text

__all__ = ["Interface", "Route", "interfaces", "ipv4_routes", "local_ipv4_addresses",
           "unattributed_ipv4"]

_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_RTF_UP = 0x1
_RTF_GATEWAY = 0x2


@dataclass(frozen=True, slots=True, kw_only=True)
class Interface:
    """One network interface of this host."""

    name: str
    ifindex: int | None
    """The kernel's index; NCCL and gloo walk interfaces in this order."""
    is_up: bool
    """Administratively up (``IFF_UP``)."""
    operstate: str | None
    """The link as the kernel sees it: ``up``, ``down``, ``unknown`` (normal for ``lo``)..."""
    is_loopback: bool
    mtu: int | None
    speed_mbps: int | None
    """Link speed; ``None`` where the driver does not say (virtual links, loopback)."""
    ipv4: tuple[str, ...]
    """``address/prefix`` entries, e.g. ``10.0.0.5/24``."""
    ipv6: tuple[str, ...]

    @property
    def peer_addresses(self) -> tuple[str, ...]:
        """The addresses another host could connect to: IPv4 first, then IPv6 without link-local
        ones (those need a scope id no launcher passes).

        Example::

            eth0.peer_addresses   # ('10.0.0.5',)
        """
        v6 = [a.split("/")[0] for a in self.ipv6]
        return (tuple(a.split("/")[0] for a in self.ipv4)
                + tuple(a for a in v6 if not ipaddress.ip_address(a).is_link_local))


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """One IPv4 route of the main table."""

    interface: str
    destination: str
    prefix_len: int
    gateway: str | None
    """The next hop, ``None`` for a directly connected subnet."""
    metric: int

    def contains(self, address: str) -> bool:
        """Whether ``address`` falls in this route's destination.

        Example::

            Route(interface="eth0", destination="10.0.0.0", prefix_len=8, gateway=None,
                  metric=0).contains("10.1.2.3")   # True
        """
        net = ipaddress.ip_network(f"{self.destination}/{self.prefix_len}", strict=False)
        return ipaddress.ip_address(address) in net


def _hex_ipv4(text: str) -> str:
    # /proc/net/route prints addresses as host-order (little-endian) hex words.
    return socket.inet_ntoa(struct.pack("<I", int(text, 16)))


def ipv4_routes(proc_root: str | Path = "/proc") -> list[Route]:
    """The IPv4 routes that are up, from ``/proc/net/route``; ``[]`` when unreadable.

    Example::

        ipv4_routes()
        # [Route(interface='eth0', destination='0.0.0.0', prefix_len=0, gateway='192.0.2.1', metric=0), ...]
    """
    text = read_text(Path(proc_root) / "net/route") or ""
    routes = []
    for line in text.splitlines()[1:]:
        cells = line.split()
        if len(cells) < 8:
            continue
        try:
            flags = int(cells[3], 16)
            mask = int(cells[7], 16)
            route = Route(interface=cells[0], destination=_hex_ipv4(cells[1]),
                          prefix_len=bin(mask).count("1"),
                          gateway=_hex_ipv4(cells[2]) if flags & _RTF_GATEWAY else None,
                          metric=int(cells[6]))
        except ValueError:
            continue
        if flags & _RTF_UP:
            routes.append(route)
    return routes


def local_ipv4_addresses(proc_root: str | Path = "/proc") -> list[str]:
    """This host's own IPv4 addresses (the ``/32 host LOCAL`` entries of ``/proc/net/fib_trie``).

    Example::

        local_ipv4_addresses()   # ['10.0.0.5', '127.0.0.1']
    """
    text = read_text(Path(proc_root) / "net/fib_trie") or ""
    found: list[str] = []
    last = None
    for line in text.splitlines():
        leaf = re.match(r"^\s*\|--\s+(\d+\.\d+\.\d+\.\d+)\s*$", line)
        if leaf:
            last = leaf.group(1)
        elif last and re.match(r"^\s*/32 host LOCAL", line) and last not in found:
            found.append(last)
    return sorted(found, key=lambda a: ipaddress.ip_address(a))


def _ipv4_owner(address: str, routes: list[Route], loopback: str | None) -> tuple[str, int] | None:
    if ipaddress.ip_address(address).is_loopback:
        return (loopback, 8) if loopback else None
    subnets = [r for r in routes if r.gateway is None and r.prefix_len > 0 and r.contains(address)]
    if not subnets:
        return None
    best = max(subnets, key=lambda r: (r.prefix_len, -r.metric))
    return best.interface, best.prefix_len


def _ipv6_by_interface(proc_root: Path) -> dict[str, list[str]]:
    text = read_text(proc_root / "net/if_inet6") or ""
    by_name: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) != 6 or len(cells[0]) != 32:
            continue
        address = ipaddress.IPv6Address(bytes.fromhex(cells[0]))
        by_name.setdefault(cells[5], []).append(f"{address}/{int(cells[2], 16)}")
    return by_name


def _int(text: str | None, base: int = 10) -> int | None:
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None


def interfaces(sys_root: str | Path = "/sys", proc_root: str | Path = "/proc") -> list[Interface]:
    """Every network interface with its state and addresses, in the kernel's index order.

    Example::

        [(i.name, i.ipv4) for i in interfaces()]   # [('lo', ('127.0.0.1/8',)), ('eth0', ('10.0.0.5/24',))]
    """
    base = Path(sys_root) / "class/net"
    routes = ipv4_routes(proc_root)
    local = local_ipv4_addresses(proc_root)
    ipv6 = _ipv6_by_interface(Path(proc_root))
    raw = []
    for entry in sorted(base.iterdir() if base.is_dir() else []):
        flags = _int(read_text(entry / "flags"), 16) or 0
        speed = _int(read_text(entry / "speed"))
        raw.append((entry.name, flags, speed, entry))
    loopback = next((name for name, flags, _, _ in raw if flags & _IFF_LOOPBACK), None)
    owned: dict[str, list[str]] = {}
    for address in local:
        owner = _ipv4_owner(address, routes, loopback)
        if owner is not None:
            owned.setdefault(owner[0], []).append(f"{address}/{owner[1]}")
    found = [Interface(name=name, ifindex=_int(read_text(entry / "ifindex")), is_up=bool(flags & _IFF_UP),
                       operstate=read_text(entry / "operstate"), is_loopback=bool(flags & _IFF_LOOPBACK),
                       mtu=_int(read_text(entry / "mtu")),
                       speed_mbps=speed if speed is not None and speed > 0 else None,
                       ipv4=tuple(owned.get(name, [])), ipv6=tuple(ipv6.get(name, [])))
             for name, flags, speed, entry in raw]
    return sorted(found, key=lambda i: (i.ifindex is None, i.ifindex or 0, i.name))


def unattributed_ipv4(ifaces: list[Interface], proc_root: str | Path = "/proc") -> list[str]:
    """This host's IPv4 addresses that none of ``ifaces`` holds (see the module's note).

    Example::

        unattributed_ipv4(interfaces())   # [] when every address sits in a connected subnet
    """
    attributed = {a.split("/")[0] for i in ifaces for a in i.ipv4}
    return [a for a in local_ipv4_addresses(proc_root) if a not in attributed]
