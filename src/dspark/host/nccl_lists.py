"""NCCL's interface-list syntax, as ``NCCL_SOCKET_IFNAME`` and ``NCCL_IB_HCA`` spell it.

A comma-separated list of name prefixes (``eth,ib`` selects ``eth0`` and ``ib1``); a leading ``=``
makes them exact names (``=eth0`` does not select ``eth01``); a leading ``^`` turns the list into
exclusions (``^docker,lo``); ``^=`` excludes exact names. ``NCCL_IB_HCA`` entries may name a port
after a colon (``mlx5_0:1``). Pure functions: ``dspark env`` uses them to say which interfaces and
HCAs NCCL would take, without starting NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NcclList", "parse_nccl_list"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NcclList:
    """A parsed NCCL name list."""

    exclude: bool
    """``^``: the list names what NCCL must not use."""
    exact: bool
    """``=``: names match whole, not as prefixes."""
    entries: tuple[tuple[str, int | None], ...]
    """``(name, port)`` pairs; ``port`` is ``None`` when the entry names no port."""

    def selects(self, name: str, port: int | None = None) -> bool:
        """Whether NCCL would take interface (or HCA) ``name`` (and its ``port``) under this list.

        Example::

            parse_nccl_list("^docker,lo").selects("eth0")   # True
        """
        hit = any((name == want if self.exact else name.startswith(want))
                  and (want_port is None or port is None or port == want_port)
                  for want, want_port in self.entries)
        return hit != self.exclude


def parse_nccl_list(spec: str) -> NcclList:
    """Parse ``NCCL_SOCKET_IFNAME`` / ``NCCL_IB_HCA`` syntax.

    Example::

        parse_nccl_list("=mlx5_0:1,mlx5_1")
        # NcclList(exclude=False, exact=True, entries=(('mlx5_0', 1), ('mlx5_1', None)))
    """
    text = spec.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, port = item.partition(":")
        if port and not port.isdigit():
            raise ValueError(f"{spec!r}: port {port!r} of entry {item!r} is not a number "
                             f"(NCCL syntax: 'mlx5_0:1,mlx5_1')")
        entries.append((name, int(port) if port else None))
    return NcclList(exclude=exclude, exact=exact, entries=tuple(entries))
