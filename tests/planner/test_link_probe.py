"""measure_link on 2 real gloo ranks: each collective measured apart, and the ranks' co-run slowdown,
the same answer on every rank."""

from __future__ import annotations

import dspark
from dspark.planner.interconnect import COLLECTIVES, all_gather_s
from dspark.planner.link_probe import measure_link


def _measure() -> tuple:
    link = measure_link(dspark.get_world(), sizes=(4096, 1 << 20), repeats=2, co_run_sizes=(1 << 16, 1 << 18))
    return link.per_collective, link.overlaps_compute, all_gather_s(1 << 20, 2, link), link.co_run


def test_every_rank_gets_the_same_link_with_each_collective_apart(pool) -> None:
    first, second = pool.run(_measure)
    assert first == second
    per_collective, overlaps, gather_s, co_run = first
    assert [name for name, _ in per_collective] == list(COLLECTIVES)
    assert all(cost.bytes_per_s > 0 and cost.latency_s >= 0 for _, cost in per_collective)
    assert overlaps is False and 0 < gather_s < 1.0  # gloo: the computing core moves the bytes
    # the slowdown of a rank's passes beside the other's: measured at each size asked, on both ranks
    assert co_run.ranks == 2 and [size for size, _, _ in co_run.pass_points] == [1 << 16, 1 << 18]
    assert all(alone > 0 and together > 0 for _, alone, together in co_run.pass_points)
    assert co_run.compute_factor >= 1.0 and co_run.pass_factor(1 << 17) >= 1.0
