"""The collective formulas of [Note: collective time], checked against the arithmetic by hand."""

from __future__ import annotations

import math

import pytest

from dspark.plan import INTERCONNECTS, Interconnect, get_interconnect
from dspark.plan.interconnect import all_gather_s, all_reduce_s, reduce_scatter_s

LINK = Interconnect(name="test", bytes_per_s=1e9, latency_s=1e-5, source="by hand")


def test_one_rank_and_no_bytes_cost_nothing() -> None:
    assert all_reduce_s(10**9, 1, LINK) == 0.0
    assert reduce_scatter_s(0, 8, LINK) == 0.0


def test_ring_terms() -> None:
    # 4 ranks, 1 GB: all-reduce 2*3 hops of latency + 2*(3/4) of the bytes over the link
    assert all_reduce_s(10**9, 4, LINK) == pytest.approx(6e-5 + 1.5)
    assert reduce_scatter_s(10**9, 4, LINK) == pytest.approx(3e-5 + 0.75)
    assert all_gather_s(10**9, 4, LINK) == reduce_scatter_s(10**9, 4, LINK)


def test_tree_wins_on_latency_at_many_ranks() -> None:
    n, nbytes = 512, 1000
    ring = 2 * (n - 1) * LINK.latency_s + 2 * (n - 1) / n * nbytes / LINK.bytes_per_s
    tree = 2 * math.ceil(math.log2(n)) * LINK.latency_s + 2 * nbytes / LINK.bytes_per_s
    assert tree < ring
    assert all_reduce_s(nbytes, n, LINK) == pytest.approx(tree)


def test_nvlink_crosses_to_infiniband_beyond_a_node() -> None:
    nvlink = get_interconnect("nvlink")
    assert nvlink.link_for(8) is nvlink
    assert nvlink.link_for(16).name == "infiniband-ndr"
    assert all_gather_s(10**9, 16, nvlink) > 5 * all_gather_s(10**9, 8, nvlink)


def test_every_profile_names_its_source_and_unknown_names_list_the_valid_ones() -> None:
    assert {"nvlink", "pcie", "roce-200g", "infiniband-ndr", "loopback-gloo"} <= set(INTERCONNECTS)
    assert all(p.source for p in INTERCONNECTS.values())
    with pytest.raises(ValueError, match="roce-200g"):
        get_interconnect("ethernet")
    with pytest.raises(ValueError, match="bytes_per_s"):
        Interconnect(name="bad", bytes_per_s=0, latency_s=0, source="")
