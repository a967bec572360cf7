"""The saving is real, not only reported: a zero3 rank's peak resident memory is lower than a
replicate rank's by at least half of the 8 bytes/param that sharding should save on 2 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.launch.launcher import LaunchSpec, launch

WORKER = Path(__file__).with_name("rss_worker.py")


def _peaks(strategy: str) -> list[dict]:
    done = launch(LaunchSpec(nproc=2, target=str(WORKER), args=(strategy,)), capture=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # both ranks print to one pipe, so one rank's line can land inside the other's: decode each
    # object where it starts instead of line by line
    decoder = json.JSONDecoder()
    starts = [i for i in range(len(done.stdout)) if done.stdout.startswith('{"rank"', i)]
    rows = [decoder.raw_decode(done.stdout, i)[0] for i in starts]
    assert len(rows) == 2, done.stdout
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.slow
def test_zero3_peak_rss_is_lower_than_replicate_by_the_sharded_bytes() -> None:
    replicate, zero3 = _peaks("replicate"), _peaks("zero3")
    num_params = replicate[0]["num_params"]
    assert num_params > 80_000_000
    for rep, z3 in zip(replicate, zero3, strict=True):
        saved = rep["peak_bytes"] - z3["peak_bytes"]
        assert saved >= 4 * num_params, (
            f"rank {rep['rank']}: replicate peak {rep['peak_bytes'] / 2**20:.0f} MiB, zero3 peak "
            f"{z3['peak_bytes'] / 2**20:.0f} MiB: saved {saved / num_params:.2f} bytes/param, want >= 4")
