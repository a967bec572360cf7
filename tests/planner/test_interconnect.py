"""The collective formulas of [Note: collective time], checked against the arithmetic by hand."""

from __future__ import annotations

import math

import pytest

from dspark.planner import INTERCONNECTS, Interconnect, get_interconnect
from dspark.planner.interconnect import LinkCost, all_gather_s, all_reduce_s, reduce_scatter_s

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


def test_a_collective_measured_apart_uses_its_own_terms() -> None:
    from dspark.planner.interconnect import LinkCost

    link = Interconnect(name="apart", bytes_per_s=1e9, latency_s=1e-5, source="by hand",
                        per_collective=(("all_gather", LinkCost(bytes_per_s=4e9, latency_s=1e-3)),))
    assert all_gather_s(10**9, 2, link) == pytest.approx(1e-3 + 0.5 / 4)
    assert reduce_scatter_s(10**9, 2, link) == pytest.approx(1e-5 + 0.5)  # the link's own terms
    with pytest.raises(ValueError, match="'broadcast'"):
        Interconnect(name="bad", bytes_per_s=1e9, latency_s=0, source="",
                     per_collective=(("broadcast", LinkCost(bytes_per_s=1e9, latency_s=0)),))


def test_the_link_probe_fit_reads_the_ring_terms_back() -> None:
    from dspark.planner.link_probe import fit_link_cost

    truth = Interconnect(name="t", bytes_per_s=2e9, latency_s=3e-5, source="by hand")
    for collective, formula in (("all_reduce", all_reduce_s), ("reduce_scatter", reduce_scatter_s),
                                ("all_gather", all_gather_s)):
        points = tuple((s, formula(s, 2, truth)) for s in (1 << 16, 1 << 23))
        cost = fit_link_cost(collective, 2, points)  # type: ignore[arg-type]
        assert (cost.bytes_per_s, cost.latency_s) == (pytest.approx(2e9), pytest.approx(3e-5)), collective
    with pytest.raises(ValueError, match="num_ranks=1"):
        fit_link_cost("all_reduce", 1, ((1, 1.0), (2, 2.0)))


def test_a_link_probe_past_the_cache_prices_large_calls_at_the_slower_rate() -> None:
    from dspark.planner.link_probe import fit_link_cost

    cached = LinkCost(bytes_per_s=1e9, latency_s=1e-4, cached_bytes=2 << 20, cached_bytes_per_s=4e9)
    link = Interconnect(name="t", bytes_per_s=1e9, latency_s=1e-4, source="by hand",
                        per_collective=(("all_gather", cached),))
    # half of 4 MiB moves through the cache; of 24 MiB, 2 MiB does and 10 MiB goes at the memory's rate
    assert all_gather_s(4 << 20, 2, link) == pytest.approx(1e-4 + (2 << 20) / 4e9)
    assert all_gather_s(24 << 20, 2, link) == pytest.approx(1e-4 + (2 << 20) / 4e9 + (10 << 20) / 1e9)
    points = tuple((s, all_gather_s(s, 2, link)) for s in (64 << 10, 4 << 20, 24 << 20))
    fitted = fit_link_cost("all_gather", 2, points)
    assert (fitted.bytes_per_s, fitted.cached_bytes_per_s, fitted.latency_s, fitted.cached_bytes) == (
        pytest.approx(1e9), pytest.approx(4e9), pytest.approx(1e-4), 2 << 20)
    even = fit_link_cost("all_gather", 2, tuple((s, 1e-4 + s / 2 / 1e9) for s in (1 << 16, 1 << 22, 24 << 20)))
    assert (even.bytes_per_s, even.cached_bytes) == (pytest.approx(1e9), 0.0)  # no edge: one rate
