"""measure_link on 2 real gloo ranks: each collective measured apart, the same answer on every rank."""

from __future__ import annotations

import dspark
from dspark.planner.interconnect import COLLECTIVES, all_gather_s
from dspark.planner.link_probe import measure_link


def _measure() -> tuple:
    link = measure_link(dspark.get_world(), sizes=(4096, 1 << 20), repeats=2)
    return link.per_collective, link.overlaps_compute, all_gather_s(1 << 20, 2, link)


def test_every_rank_gets_the_same_link_with_each_collective_apart(pool) -> None:
    first, second = pool.run(_measure)
    assert first == second
    per_collective, overlaps, gather_s = first
    assert [name for name, _ in per_collective] == list(COLLECTIVES)
    assert all(cost.bytes_per_s > 0 and cost.latency_s >= 0 for _, cost in per_collective)
    assert overlaps is False and 0 < gather_s < 1.0  # gloo: the computing core moves the bytes
