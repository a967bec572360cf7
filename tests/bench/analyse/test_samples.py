"""Throughput and speedup from the samples the probe counted; a rank short of its share is flagged."""

from __future__ import annotations

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.analyse.samples import counted_samples, missing_samples, rank_share
from dspark.bench.ledger.measurement import results_from_measurements
from tests.bench.factory import kinds, make_measurement
from tests.messages import assert_line_names


def _batch(samples: list[int]) -> dict[str, object]:
    return {"samples_by_rank": samples, "identical_input_ranks": [], "replicated_modules": [],
            "replicated_module_count": 0}


def _run(two_device_samples: list[int]) -> list:
    one = make_measurement(num_devices=1, global_batch=32, step_ms_by_rank=[[400.0] * 3],
                           rank_loads=make_measurement().rank_loads[:1], batch=_batch([32]),
                           state_held_by_rank=make_measurement().state_held_by_rank[:1],
                           state_expected_by_rank=make_measurement().state_expected_by_rank[:1],
                           tensor_peak_bytes_by_rank=[90_000_000], rss_peak_bytes_by_rank=[1])
    two = make_measurement(global_batch=32, step_ms_by_rank=[[196.0] * 3] * 2,
                           batch=_batch(two_device_samples))
    return annotate(results_from_measurements([one, two]))


def test_a_run_that_trained_fewer_samples_is_not_a_faster_run() -> None:
    # The finding: ranks that trained 12 of their 16 samples each showed 2.04x and no anomaly.
    honest = _run([16, 16])[1]
    assert honest.speedup == pytest.approx(400 / 196) and "missing_samples" not in kinds(honest)
    assert honest.samples_per_step == 32 and honest.samples_per_s == pytest.approx(32 / 0.196)
    short = _run([12, 12])[1]
    assert short.samples_per_step == 24
    assert short.samples_per_s == pytest.approx(24 / 0.196)
    assert short.speedup == pytest.approx(400 / 196 * 24 / 32)
    assert "missing_samples" in kinds(short)
    (found,) = missing_samples(short)
    assert found["trained_samples"] == 24 and found["share"] == 16
    assert_line_names(found["message"], "rank 0", "12", "rank 1", "12")


def test_counting_rules() -> None:
    assert counted_samples([12, 12], 32) == 24
    assert counted_samples([32, 32], 32) == 32  # a replicated batch trains its samples once
    assert counted_samples([], 32) == 0
    assert rank_share(7, 2) == 3  # torch.chunk: 4 + 3
    uncounted = _run([])[1]
    assert uncounted.samples_per_step == 0 and uncounted.samples_per_s == pytest.approx(32 / 0.196)
    assert missing_samples(uncounted) == []
