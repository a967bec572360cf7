"""The link between this world's ranks, measured: each collective the engine uses, timed apart.

[Note: the link probe] Every rank runs the same short program through :mod:`dspark.comm` (the
functions, transport and dtype the engine's buckets and zero3 gathers use): all-reduce,
reduce-scatter and all-gather, each at the sizes of :data:`SIZES`, ``repeats`` times after a
warm-up, a barrier before each call so that a call's time is its own and not the wait for a late
rank. The time of one call is the slowest rank's (a collective ends when its last rank does), the
median over the repeats (a probe under load keeps its typical call, not its luckiest). The two
smallest sizes give each collective a line ``fixed + per_byte * S``, read back through [Note:
collective time]'s ring terms for this ``N``: an all-reduce's fixed time is ``2 (N-1) a`` and its
bytes ``2 (N-1)/N * S / B``, the others' ``(N-1) a`` and ``(N-1)/N * S / B``. The largest size,
past a CPU core's cache, gives the rate of the bytes beyond the middle size's where it is slower:
through shared memory a bucket of the engine's default size moves at the memory's rate, and a line
through a small and a cached size alone priced it several times too fast (a short step's buckets and zero3's large
gathers were planned low). The all-gather's output is allocated for each call, as a zero3 gather's
is. Rank 0's answer is broadcast, so every rank plans alike. On a CPU the same world also measures
how much slower a rank's own passes run when every rank runs them at once (:func:`measure_co_run`,
[Note: co-run slowdown] in :mod:`dspark.planner.co_run`): it travels with the link.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dspark import comm
from dspark.planner.co_run import CO_RUN_SIZES, CoRun
from dspark.planner.interconnect import COLLECTIVES, Interconnect, LinkCost

__all__ = ["CACHE_EDGE", "SIZES", "fit_link_cost", "measure_co_run", "measure_link"]

SIZES = (64 << 10, 4 << 20, 24 << 20)
"""Bytes per call (the whole buffer, as the formulas count ``S``): one latency-bound, one that a
core's cache holds, and one the size of a bucket (the engine's default ``bucket_mb``), larger than the
cache, so that its bytes move at the memory's rate as a step's buckets and large gathers do, and
below the mmap threshold of :mod:`dspark.cpu_malloc`, so that the all-gather's fresh output costs no
page faults (the plan counts those apart: :func:`dspark.planner.cost.fresh_map_ms`)."""

CACHE_EDGE = 1.1
"""How much slower the bytes past the middle size must move for :func:`fit_link_cost` to keep two
rates: closer than that, the three points are one line's, up to a probe's noise."""


def fit_link_cost(collective: str, num_ranks: int, points: tuple[tuple[int, float], ...]) -> LinkCost:
    """``collective``'s terms from two or three measured ``(bytes, seconds)`` calls on ``num_ranks``
    ranks (see [Note: the link probe]): the latency and a rate from the two smallest; with a third,
    the rate past the middle size's bytes from the two largest where it is slower by more than
    :data:`CACHE_EDGE` (a cache's edge,
    :attr:`dspark.planner.interconnect.LinkCost.cached_bytes`). A time that does not grow with the
    bytes is read as latency only with a bandwidth of 1 TB/s.

    Example::

        fit_link_cost("all_gather", 2, ((65536, 1e-4), (8388608, 3e-3)))
        fit_link_cost("all_gather", 2, ((65536, 1e-4), (4 << 20, 1.5e-3), (24 << 20, 2e-2)))
    """
    if collective not in COLLECTIVES or num_ranks < 2:
        raise ValueError(f"collective={collective!r} must be one of {', '.join(COLLECTIVES)} and "
                         f"num_ranks={num_ranks!r} >= 2")
    ordered = sorted(points)
    if len(ordered) not in (2, 3) or len({s for s, _ in ordered}) != len(ordered):
        raise ValueError(f"points={points!r}: two or three different sizes are needed")
    share = (num_ranks - 1) / num_ranks * (2 if collective == "all_reduce" else 1)
    hops = (num_ranks - 1) * (2 if collective == "all_reduce" else 1)
    (s0, t0), (s1, t1) = ordered[0], ordered[1]
    per_byte = max((t1 - t0) / (s1 - s0), 0.0)
    fixed = max(t1 - per_byte * s1, 0.0)
    rate = share / per_byte if per_byte > 0 else 1e12
    if len(ordered) == 3:
        s2, t2 = ordered[2]
        beyond = (t2 - t1) / (s2 - s1)
        if beyond > CACHE_EDGE * per_byte:  # past the cache: slower
            return LinkCost(bytes_per_s=share / beyond, latency_s=fixed / hops, cached_bytes=share * s1,
                            cached_bytes_per_s=rate)
        per_byte = max((t2 - t0) / (s2 - s0), 0.0)  # one rate: the line through the ends
        fixed = max(t2 - per_byte * s2, 0.0)
        rate = share / per_byte if per_byte > 0 else 1e12
    return LinkCost(bytes_per_s=rate, latency_s=fixed / hops)


def _time_call(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The median over ``repeats`` of the slowest rank's seconds for ``call``."""
    call()  # warm-up: connections, buffers, the transport's regions
    mine = []
    for _ in range(repeats):
        comm.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        mine.append(time.perf_counter() - start)
    everyone = comm.all_gather_object(mine, label="dspark.link_probe.times")
    return statistics.median(max(ts) for ts in zip(*everyone, strict=True))


def _calls(collective: str, nbytes: int, n: int, device: torch.device,
           group: comm.Group | None = None) -> Callable[[], object]:
    numel = max(n, nbytes // 4 // n * n)  # fp32, a multiple of N
    whole = torch.ones(numel, dtype=torch.float32, device=device)
    if collective == "all_reduce":
        return lambda: comm.all_reduce(whole, group=group, label="dspark.link_probe.all_reduce")
    if collective == "reduce_scatter":
        out = torch.empty(numel // n, dtype=torch.float32, device=device)
        return lambda: comm.reduce_scatter_tensor(out, whole, group=group, label="dspark.link_probe.reduce_scatter")
    shard = whole[: numel // n].clone()
    return lambda: comm.all_gather_parts([shard], [torch.empty(numel, dtype=torch.float32, device=device)],
                                         group=group, label="dspark.link_probe.all_gather")


def _timed_s(call: Callable[[], object]) -> float:
    """Seconds of ``call`` run right after one more untimed: a core that waited idle at a barrier
    runs its first pass slower, alone or not, which is no part of the slowdown measured."""
    call()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _alone_and_together_s(world: comm.World, call: Callable[[], object], repeats: int) -> tuple[float, float]:
    """``call``'s seconds run by one rank at a time while the others wait at a barrier, and run by
    every rank at once, in ``repeats`` rounds of both (so that a load that comes and goes meets both
    alike): the median over the rounds of the slowest rank's time."""
    call()  # warm-up
    rounds = []
    for _ in range(repeats):
        alone = 0.0
        for turn in range(world.world_size):
            comm.barrier()
            if world.rank == turn:
                alone = _timed_s(call)
        comm.barrier()
        rounds.append((alone, _timed_s(call)))
    everyone = comm.all_gather_object(rounds, label="dspark.link_probe.co_run")
    slowest = [(max(a for a, _ in per_rank), max(t for _, t in per_rank)) for per_rank in zip(*everyone, strict=True)]
    return statistics.median(a for a, _ in slowest), statistics.median(t for _, t in slowest)


def _copies(nbytes: int, times: int) -> Callable[[], object]:
    """``times`` copies between two buffers of ``nbytes`` together."""
    src = torch.ones(max(1, nbytes // 8), dtype=torch.float32)
    dst = torch.empty_like(src)

    def call() -> None:
        for _ in range(times):
            dst.copy_(src)
    return call


def _matmuls(side: int = 384, times: int = 4) -> Callable[[], object]:
    """``times`` products of two ``side`` x ``side`` float32 matrices: operands a core's cache holds,
    so the time is the arithmetic's."""
    a, b = torch.rand(side, side), torch.rand(side, side)
    out = torch.empty(side, side)

    def call() -> None:
        for _ in range(times):
            torch.mm(a, b, out=out)
    return call


def measure_co_run(world: comm.World, *, sizes: tuple[int, ...] = CO_RUN_SIZES, repeats: int = 5) -> CoRun | None:
    """How much slower a rank's passes run when every rank of the world runs them at once than when
    one runs alone (see [Note: co-run slowdown] in :mod:`dspark.planner.co_run`): a copy at each
    working set of ``sizes`` and a matrix multiply, each first one rank at a time, then all at once;
    the slowest rank's medians. Call it on every rank; every rank gets the same answer. None on one
    rank or on a GPU (each rank has its own device).

    Example::

        co_run = measure_co_run(dspark.get_world())
        co_run.pass_factor(48 << 20)   # a memory-bound pass past the cache, every rank at once
    """
    if world.world_size < 2 or world.device.type != "cpu" or not sizes:
        return None
    points = []
    for nbytes in sorted(sizes):  # each call long enough that the ranks' calls overlap past a barrier's skew
        times = max(1, max(sizes) // nbytes)
        alone, together = _alone_and_together_s(world, _copies(nbytes, times), repeats)
        points.append((nbytes, alone / times, together / times))
    compute_alone, compute_together = _alone_and_together_s(world, _matmuls(), repeats)
    return CoRun(ranks=world.world_size, pass_points=tuple(points), compute_alone_s=compute_alone,
                 compute_together_s=compute_together)


def measure_link(world: comm.World, *, sizes: tuple[int, ...] = SIZES, repeats: int = 5,
                 overlaps_compute: bool | None = None, group: comm.Group | None = None,
                 co_run_sizes: tuple[int, ...] = CO_RUN_SIZES) -> Interconnect:
    """This world's link, each collective measured apart (see [Note: the link probe]); call it on
    every rank. ``overlaps_compute`` defaults to False on gloo (the computing core moves the bytes).
    ``group``: measure inside this rank's group of a partition instead (every group at once, e.g.
    one node's ranks: :func:`dspark.comm.partition_groups`); rank 0's group answers. On a CPU, and
    without a ``group``, it measures the ranks' co-run slowdown too (:func:`measure_co_run` at
    ``co_run_sizes``; empty: not measured): :attr:`Interconnect.co_run`. On one rank there is nothing
    to measure: ``ValueError``.

    Example::

        link = measure_link(dspark.get_world())
        dspark.plan(model, batch, loss_fn, devices=[2], interconnect=link)
    """
    n = world.world_size if group is None else group.size
    if n < 2:
        raise ValueError(f"measure_link needs >= 2 ranks; this world has world_size={n}")
    costs = []
    for collective in COLLECTIVES:
        points = tuple((nbytes, _time_call(_calls(collective, nbytes, n, world.device, group), repeats, world.device))
                       for nbytes in sizes)
        costs.append((collective, fit_link_cost(collective, n, points)))  # type: ignore[arg-type]
    co_run = measure_co_run(world, sizes=co_run_sizes, repeats=repeats) if group is None else None
    costs, co_run = comm.broadcast_object((costs, co_run), label="dspark.link_probe.result")
    reduce = dict(costs)["all_reduce"]
    transport = comm.transport()
    return Interconnect(name=f"measured-{transport}-{n}", bytes_per_s=reduce.bytes_per_s,
                        latency_s=reduce.latency_s, per_collective=tuple(costs),
                        overlaps_compute=world.backend != "gloo" if overlaps_compute is None else overlaps_compute,
                        co_run=co_run,
                        source=f"measured on {n} ranks through {transport} ({world.device.type}), "
                               f"{repeats} calls at each of {', '.join(map(str, sizes))} bytes per collective")
