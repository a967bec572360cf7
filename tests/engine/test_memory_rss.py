"""The saving is real, not only reported: a zero3 rank's peak resident memory is lower than a
replicate rank's by at least half of the 8 bytes/param that sharding should save on 2 ranks."""

from __future__ import annotations

import pytest

from dspark.bench.measure.rss_worker import peak_rss_per_rank


@pytest.mark.slow
def test_zero3_peak_rss_is_lower_than_replicate_by_the_sharded_bytes() -> None:
    replicate, zero3 = peak_rss_per_rank("replicate"), peak_rss_per_rank("zero3")
    num_params = replicate[0]["num_params"]
    assert num_params > 80_000_000
    for rep, z3 in zip(replicate, zero3, strict=True):
        saved = rep["peak_bytes"] - z3["peak_bytes"]
        assert saved >= 4 * num_params, (
            f"rank {rep['rank']}: replicate peak {rep['peak_bytes'] / 2**20:.0f} MiB, zero3 peak "
            f"{z3['peak_bytes'] / 2**20:.0f} MiB: saved {saved / num_params:.2f} bytes/param, want >= 4")
