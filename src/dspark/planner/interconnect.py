"""How long a collective takes on a link: named interconnect profiles and the ring/tree formulas.

[Note: collective time] With ``N`` ranks, ``S`` bytes per rank, a per-rank link bandwidth ``B``
(bytes/s, one direction) and a per-hop latency ``a`` (seconds), the ring algorithms take:

* all-reduce:                 ``2 (N-1) a + 2 (N-1)/N * S / B``
* reduce-scatter, all-gather: ``(N-1) a + (N-1)/N * S / B``  (``S`` = the whole, gathered size)

A profile may give a collective its own ``(B, a)`` (:class:`LinkCost`): a short probe on a real
world measures each of the three apart (:mod:`dspark.planner.link_probe`), since one transport can move
an all-gather's bytes faster than an all-reduce's (no sum) and a reduce-scatter may be built from
another collective. A ring's latency term grows with ``N``; at hundreds of ranks NCCL switches to trees, whose
all-reduce takes ``2 log2(N) a + 2 S / B`` (reduce up, broadcast down, pipelined). The model takes
the faster of the two for all-reduce, as NCCL's tuner does. Reduce-scatter and all-gather stay
rings. ``N = 1`` costs nothing. These are the textbook alpha-beta costs (Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", 2005); the profiles' numbers
and their sources are listed in docs/plan.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from dspark.planner.co_run import CoRun

__all__ = ["COLLECTIVES", "INTERCONNECTS", "Interconnect", "LinkCost", "all_gather_s", "all_reduce_s",
           "get_interconnect", "reduce_scatter_s"]


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives a profile may cost apart, in the order :class:`Interconnect` keeps them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkCost:
    """One collective's own terms of [Note: collective time]."""

    bytes_per_s: float
    """Per-rank bandwidth ``B`` in one direction, as the ring formula counts it."""
    latency_s: float
    """Per-hop latency ``a``: a 2-rank ring's fixed time is ``2a`` for an all-reduce, ``a`` for the others."""
    cached_bytes: float = 0.0
    """The first bytes a rank moves in one call (as the ring formula counts them: ``(N-1)/N * S``
    for an all-gather) that go at ``cached_bytes_per_s`` instead of ``B``: a CPU's shared-memory
    collective moves a call of a few MiB through its cache, several times faster than one larger than
    the cache, whose bytes go at the memory's rate (see [Note: the link probe]). 0: one rate."""
    cached_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and self.latency_s >= 0):
            raise ValueError(f"LinkCost: bytes_per_s={self.bytes_per_s!r} must be > 0 and "
                             f"latency_s={self.latency_s!r} >= 0")
        if self.cached_bytes < 0 or (self.cached_bytes > 0 and self.cached_bytes_per_s <= 0):
            raise ValueError(f"LinkCost: cached_bytes={self.cached_bytes!r} must be >= 0, and "
                             f"cached_bytes_per_s={self.cached_bytes_per_s!r} > 0 where it is not 0")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` (a ring's bytes per rank): the cached part at its own rate,
        the rest at ``bytes_per_s``.

        Example::

            LinkCost(bytes_per_s=1e9, latency_s=0, cached_bytes=1e6, cached_bytes_per_s=4e9).transfer_s(3e6)
        """
        cached = min(nbytes, self.cached_bytes)
        return (cached / self.cached_bytes_per_s if cached > 0 else 0.0) + (nbytes - cached) / self.bytes_per_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Interconnect:
    """One link between ranks, as the collectives see it."""

    name: str
    """Registry name, e.g. ``"nvlink"``."""
    bytes_per_s: float
    """Per-rank bandwidth in one direction (what a ring moves each step)."""
    latency_s: float
    """Per-hop latency of one message."""
    source: str
    """Where the numbers come from."""
    ranks_per_node: int | None = None
    """Ranks that share ``bytes_per_s``'s fast link; beyond it ``inter_node`` carries the ring."""
    inter_node: Interconnect | None = None
    """The slower link between nodes (a two-level fabric such as NVLink inside, InfiniBand across)."""
    overlaps_compute: bool = True
    """Whether communication runs beside compute. False where the compute's own cores move and sum
    the bytes (gloo on one CPU core per rank): every collective's time then adds to the step."""
    per_collective: tuple[tuple[str, LinkCost], ...] = ()
    """``(collective, its own terms)`` for those measured apart (names from :data:`COLLECTIVES`);
    the others take ``bytes_per_s`` and ``latency_s``."""
    co_run: CoRun | None = None
    """How much slower a rank's passes run when every rank of a node runs them at once, measured on
    the ranks this link was (see [Note: co-run slowdown] in :mod:`dspark.planner.co_run`); None: not
    measured (a named profile, a GPU's ranks), and the plan prices no slowdown."""

    def __post_init__(self) -> None:
        if not (self.bytes_per_s > 0 and self.latency_s >= 0):
            raise ValueError(f"interconnect {self.name!r}: bytes_per_s={self.bytes_per_s!r} must be "
                             f"> 0 and latency_s={self.latency_s!r} >= 0")
        unknown = [name for name, _ in self.per_collective if name not in COLLECTIVES]
        if unknown:
            raise ValueError(f"interconnect {self.name!r}: per_collective names {unknown!r}; each must "
                             f"be one of {', '.join(COLLECTIVES)}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Interconnect:
        """The link ``dataclasses.asdict`` wrote (a benchmark's artifact keeps its measured link), its
        collectives' terms, co-run slowdown and link between nodes included.

        Example::

            Interconnect.from_dict(json.loads(Path("plan-validation.json").read_text())["link"])
        """
        co_run, across = data.get("co_run"), data.get("inter_node")  # older artifacts have no co_run
        costs = tuple((name, LinkCost(**cost)) for name, cost in data.get("per_collective", ()))
        return cls(**{**data, "inter_node": cls.from_dict(across) if across else None,
                      "co_run": CoRun.from_dict(co_run) if co_run else None, "per_collective": costs})

    def cost_of(self, collective: str) -> LinkCost:
        """``collective``'s ``(B, a)`` on this link: its own where measured apart, else the link's.

        Example::

            get_interconnect("nvlink").cost_of("all_gather").bytes_per_s   # 450e9
        """
        for name, cost in self.per_collective:
            if name == collective:
                return cost
        return LinkCost(bytes_per_s=self.bytes_per_s, latency_s=self.latency_s)

    def link_for(self, num_ranks: int) -> Interconnect:
        """The link a ring over ``num_ranks`` ranks is bound by: the inter-node one once the ring
        leaves a node (its slowest hop sets every step's pace)."""
        if self.inter_node is not None and self.ranks_per_node and num_ranks > self.ranks_per_node:
            return self.inter_node
        return self


def _check(nbytes: int, num_ranks: int) -> None:
    if nbytes < 0 or num_ranks < 1:
        raise ValueError(f"nbytes={nbytes!r} must be >= 0 and num_ranks={num_ranks!r} >= 1")


def all_reduce_s(nbytes: int, num_ranks: int, link: Interconnect) -> float:
    """Seconds to all-reduce ``nbytes`` over ``num_ranks`` ranks (see [Note: collective time]).

    Example::

        all_reduce_s(100_000_000, 2, get_interconnect("roce-200g"))   # ~0.004
    """
    _check(nbytes, num_ranks)
    if num_ranks == 1 or nbytes == 0:
        return 0.0
    hop = link.link_for(num_ranks).cost_of("all_reduce")
    n = num_ranks
    ring = 2 * (n - 1) * hop.latency_s + hop.transfer_s(2 * (n - 1) / n * nbytes)
    tree = 2 * math.ceil(math.log2(n)) * hop.latency_s + hop.transfer_s(2 * nbytes)
    return min(ring, tree)


def reduce_scatter_s(nbytes: int, num_ranks: int, link: Interconnect) -> float:
    """Seconds to reduce-scatter ``nbytes`` (the whole input) over ``num_ranks`` ranks (ring).

    Example::

        reduce_scatter_s(100_000_000, 2, get_interconnect("roce-200g"))   # ~0.002
    """
    return _ring_half("reduce_scatter", nbytes, num_ranks, link)


def all_gather_s(nbytes: int, num_ranks: int, link: Interconnect) -> float:
    """Seconds to all-gather ``nbytes`` (the whole output) over ``num_ranks`` ranks (ring): the
    same traffic as a reduce-scatter, over the all-gather's own terms where measured apart.

    Example::

        all_gather_s(100_000_000, 8, get_interconnect("nvlink"))
    """
    return _ring_half("all_gather", nbytes, num_ranks, link)


def _ring_half(collective: str, nbytes: int, num_ranks: int, link: Interconnect) -> float:
    _check(nbytes, num_ranks)
    if num_ranks == 1 or nbytes == 0:
        return 0.0
    hop = link.link_for(num_ranks).cost_of(collective)
    return (num_ranks - 1) * hop.latency_s + hop.transfer_s((num_ranks - 1) / num_ranks * nbytes)


_IB_NDR = Interconnect(
    name="infiniband-ndr", bytes_per_s=50e9, latency_s=5e-6,
    source="NVIDIA ConnectX-7 / Quantum-2 NDR: 400 Gb/s per port, one port per GPU in a DGX H100")
_PROFILES = (
    Interconnect(name="nvlink", bytes_per_s=450e9, latency_s=5e-6, ranks_per_node=8,
                 inter_node=_IB_NDR,
                 source="NVIDIA H100 SXM: NVLink 4, 900 GB/s per GPU both directions; 8 GPUs per "
                        "node, InfiniBand NDR between nodes"),
    Interconnect(name="pcie", bytes_per_s=64e9, latency_s=10e-6,
                 source="PCI Express 5.0 x16: 32 GT/s x 16 lanes, about 64 GB/s per direction"),
    Interconnect(name="roce-200g", bytes_per_s=25e9, latency_s=10e-6,
                 source="NVIDIA DGX Spark: ConnectX-7 SmartNIC, 200 Gb/s between two boxes"),
    _IB_NDR,
    Interconnect(name="loopback-gloo", bytes_per_s=1e9, latency_s=50e-6, overlaps_compute=False,
                 source="a round figure for gloo between CPU ranks of one machine, of the order "
                        "docs/figures.md#shm-collectives measures; --probe measures the real link"),
)

INTERCONNECTS: MappingProxyType[str, Interconnect] = MappingProxyType({p.name: p for p in _PROFILES})
"""The named interconnect profiles (read-only); ``nvlink`` crosses to InfiniBand NDR beyond 8 ranks."""


def get_interconnect(name: str) -> Interconnect:
    """The profile called ``name``; ``"INSIDE+ACROSS"`` is a two-level fabric of two profiles: the
    first's link inside a node of its ``ranks_per_node``, the second's between nodes. An unknown name
    raises ``ValueError`` listing the valid ones.

    Example::

        get_interconnect("roce-200g").bytes_per_s   # 25e9
        get_interconnect("nvlink+roce-200g").link_for(16).name   # "roce-200g": 8-GPU boxes on RoCE
    """
    if "+" in name:
        parts = name.split("+")
        if len(parts) != 2:
            raise ValueError(f"interconnect={name!r} names {len(parts)} profiles: a two-level fabric is two, "
                             "INSIDE+ACROSS (e.g. nvlink+roce-200g)")
        inside, across = (get_interconnect(part) for part in parts)
        if inside.ranks_per_node is None:
            raise ValueError(f"interconnect={name!r}: {inside.name!r} has no node size (ranks_per_node), so it "
                             f"cannot be the link inside a node; use one that has: "
                             f"{', '.join(p.name for p in _PROFILES if p.ranks_per_node)}")
        return replace(inside, name=name, inter_node=across,
                       source=f"{inside.source}; between nodes: {across.source}")
    try:
        return INTERCONNECTS[name]
    except KeyError:
        raise ValueError(f"interconnect={name!r} is not one of {', '.join(INTERCONNECTS)}, or two of them "
                         "as INSIDE+ACROSS (e.g. nvlink+roce-200g)") from None
