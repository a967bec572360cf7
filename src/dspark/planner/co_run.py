"""Ranks that share one host: how much slower a rank's passes run when every rank of the node runs
them at once, and what that adds to a row's compute and optimizer.

[Note: co-run slowdown] The probe times a step in one process on one core. On a CPU the ranks of
one machine also share its last-level cache and its memory bandwidth: a pass over a working set a
core's cache holds runs as fast beside the other ranks as alone, one past it waits for the memory
the others are also reading. A probe run alone cannot see that, so the link probe measures it on
the world it already runs on (:func:`dspark.planner.link_probe.measure_co_run`): a memory-bound pass
(a copy between two buffers) at each working set of :data:`CO_RUN_SIZES`, and a matrix multiply
whose operands the cache holds (bound by arithmetic, not memory), each first on one rank at a time
while the others wait at a barrier, then on every rank at once, in rounds of both (a load that
comes and goes meets both alike); a time is the slowest rank's, the median over the rounds. Their
ratio is the slowdown of that pass when it shares the node (:class:`CoRun`), a property of the
host, not of the model; it travels with the link (:attr:`dspark.planner.interconnect.Interconnect.co_run`).

A row with more than one rank per node on a CPU pays it on the parts the probe timed alone
(:func:`co_run_parts`), each by its own working set:

* the optimizer step and the engine's scale-and-check pass are memory-bound passes (a fused AdamW
  reads a parameter's rows, gradient and moments and writes three of them back; the check reads and
  writes the gradients): each takes the pass's slowdown at its working set, the rank's stepped rows
  (its shard where the optimizer is sharded) with their gradients and state, or its gradients;
* forward and backward mix arithmetic and memory: what their passes move through memory, counted
  once per read or write (the parameters read in forward and again in backward, the gradients
  written, the activations written in forward and read back in backward), at the pass's measured
  rate alone, is their memory time, capped at the compute time; it takes the pass's slowdown at the
  working set of the parameters and activations, and the rest of the compute takes the matrix
  multiply's. That count is an estimate: an operation that reads its input twice moves more, an
  embedding's lookup reads only the rows it looks up.

The engine's own copies around the collectives and zero3's first touches of its gathered storages
take the pass's slowdown at their working set too (:mod:`dspark.planner.cost`). What slows most is
a working set the shared cache holds for one rank but not for every rank at once: a pass alone runs
from the cache, beside the others from memory; one past the cache for a rank alone already runs at
the memory's rate, and slows beside the others only where that rate is shared too. What is left
unpriced: the memory traffic of forward and backward beyond that count, and working sets past the
largest size measured. Rows on one rank,
rows with one rank per node, and a GPU's ranks (their own device each) pay nothing.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO_CO_RUN_SIZES", "CO_RUN_SIZES", "CoRun", "CoRunParts", "co_run_parts"]

CO_RUN_SIZES = (4 << 20, 16 << 20, 32 << 20, 64 << 20, 96 << 20, 128 << 20, 256 << 20)
"""Working sets (bytes: both buffers of the copy) the memory-bound pass is timed at: from one a
core's cache holds to some past a CPU's shared cache, where the memory's rate sets the pace, closer
together where one rank's working set fits the shared cache and every rank's together may not."""

AUTO_CO_RUN_SIZES = tuple(size for size in CO_RUN_SIZES if size <= 64 << 20)
"""The sizes ``strategy="auto"`` measures: no more than about what its link probe's bucket-sized
all-gather holds at once (its input, shard and output: :data:`dspark.planner.link_probe.SIZES`), so
that measuring them hardly raises a rank's high water, which its budget counts; beyond them auto
prices no slowdown."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CoRun:
    """The slowdown of a rank's passes when every rank of its node runs them at once (see
    [Note: co-run slowdown]), as measured."""

    ranks: int
    """Ranks that ran at once."""
    pass_points: tuple[tuple[int, float, float], ...]
    """``(working-set bytes, seconds alone, seconds with every rank at once)`` of the memory-bound
    pass, by working set."""
    compute_alone_s: float
    """Seconds of the matrix multiply on one rank alone."""
    compute_together_s: float
    """The same with every rank at once."""

    def __post_init__(self) -> None:
        sizes = [size for size, _, _ in self.pass_points]
        if (not sizes or sizes != sorted(set(sizes)) or sizes[0] <= 0
                or any(alone <= 0 or together <= 0 for _, alone, together in self.pass_points)
                or self.compute_alone_s <= 0 or self.compute_together_s <= 0 or self.ranks < 2):
            raise ValueError(f"CoRun: pass_points={self.pass_points!r} must be increasing working sets with "
                             f"times > 0, compute_alone_s={self.compute_alone_s!r} and compute_together_s="
                             f"{self.compute_together_s!r} > 0, ranks={self.ranks!r} >= 2")

    @property
    def compute_factor(self) -> float:
        """How much slower the matrix multiply ran beside the other ranks (at least 1)."""
        return max(1.0, self.compute_together_s / self.compute_alone_s)

    def pass_factor(self, working_set_bytes: float) -> float:
        """How much slower a memory-bound pass over ``working_set_bytes`` runs beside the other
        ranks: the measured ratio, interpolated in the logarithm of the working set between the two
        nearest sizes, the smallest's below it; at least 1. Beyond the largest size measured, 1.0:
        nothing is known there, and past a shared cache the slowdown need not grow (a working set the
        cache holds for one rank but not for all of them is slowed most; one past it for one rank
        alone already runs at the memory's rate, which may serve every rank).

        Example::

            co_run.pass_factor(40 << 20)   # between the two sizes measured around it
        """
        if working_set_bytes > self.pass_points[-1][0]:
            return 1.0  # nothing measured there
        ratios = [(size, together / alone) for size, alone, together in self.pass_points]
        return max(1.0, self._interpolate(working_set_bytes, ratios))

    def pass_bytes_per_s(self, working_set_bytes: float) -> float:
        """The working-set bytes per second the pass moved on one rank alone at ``working_set_bytes``
        (interpolated as :meth:`pass_factor`)."""
        return self._interpolate(working_set_bytes, [(size, size / alone) for size, alone, _ in self.pass_points])

    @staticmethod
    def _interpolate(x: float, points: list[tuple[int, float]]) -> float:
        """``points``' value at ``x``, linear in ``log x`` between the two nearest, flat beyond them."""
        sizes = [size for size, _ in points]
        if x <= sizes[0]:
            return points[0][1]
        if x >= sizes[-1]:
            return points[-1][1]
        k = bisect.bisect_right(sizes, x)
        (x0, y0), (x1, y1) = points[k - 1], points[k]
        share = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + share * (y1 - y0)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CoRun:
        """The measurement ``dataclasses.asdict`` wrote (an artifact's link keeps it under ``"co_run"``).

        Example::

            CoRun.from_dict(json.loads(Path("plan-validation.json").read_text())["link"]["co_run"])
        """
        try:
            return cls(ranks=int(data["ranks"]),
                       pass_points=tuple((int(s), float(a), float(t)) for s, a, t in data["pass_points"]),
                       compute_alone_s=float(data["compute_alone_s"]),
                       compute_together_s=float(data["compute_together_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a co-run measurement written by measure_co_run: {exc!r} "
                             f"(keys: {sorted(data)})") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class CoRunParts:
    """A row's compute and optimizer beside the node's other ranks, and the factors they took."""

    compute_ms: float
    optimizer_ms: float
    check_ms: float
    compute_factor: float
    """``compute_ms`` over the probe's alone (1.0: not slowed)."""
    optimizer_factor: float
    """The optimizer step's and check pass's together over theirs alone."""


def co_run_parts(co_run: CoRun | None, *, compute_ms: float, optimizer_ms: float, check_ms: float,
                 compute_working_set_bytes: float, compute_traffic_bytes: float,
                 optimizer_working_set_bytes: float, check_working_set_bytes: float) -> CoRunParts:
    """A row's compute, optimizer step and check pass (each timed alone) when the other ranks of its
    node run theirs at once (see [Note: co-run slowdown]); ``co_run`` None (one rank per node, a GPU,
    a link without the measurement) leaves them as they are.

    Example::

        co_run_parts(link.co_run, compute_ms=35.0, optimizer_ms=10.0, check_ms=1.0,
                     compute_working_set_bytes=50e6, compute_traffic_bytes=130e6,
                     optimizer_working_set_bytes=80e6, check_working_set_bytes=20e6)
    """
    if co_run is None:
        return CoRunParts(compute_ms=compute_ms, optimizer_ms=optimizer_ms, check_ms=check_ms,
                          compute_factor=1.0, optimizer_factor=1.0)
    memory_ms = min(compute_ms, 1e3 * compute_traffic_bytes / co_run.pass_bytes_per_s(compute_working_set_bytes))
    compute = (memory_ms * co_run.pass_factor(compute_working_set_bytes)
               + (compute_ms - memory_ms) * co_run.compute_factor)
    optimizer = optimizer_ms * co_run.pass_factor(optimizer_working_set_bytes)
    check = check_ms * co_run.pass_factor(check_working_set_bytes)
    alone = optimizer_ms + check_ms
    return CoRunParts(compute_ms=compute, optimizer_ms=optimizer, check_ms=check,
                      compute_factor=compute / compute_ms if compute_ms > 0 else 1.0,
                      optimizer_factor=(optimizer + check) / alone if alone > 0 else 1.0)
