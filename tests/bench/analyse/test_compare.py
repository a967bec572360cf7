from __future__ import annotations

import pytest

from dspark.bench.analyse.compare import compare
from tests.bench.factory import MB, make_result
from tests.messages import assert_names


def test_verdicts_deltas_and_one_sided_rows() -> None:
    a = [make_result(workload="same", step_ms=100.0),
         make_result(workload="slower", step_ms=100.0),
         make_result(workload="faster", step_ms=100.0),
         make_result(workload="noisy", step_ms=100.0, step_ms_p10=80.0, step_ms_p90=120.0),
         make_result(workload="gone", step_ms=100.0)]
    b = [make_result(workload="same", step_ms=103.0),
         make_result(workload="slower", step_ms=120.0, peak_bytes_per_rank=3000 * MB),
         make_result(workload="faster", step_ms=80.0),
         make_result(workload="noisy", step_ms=130.0),
         make_result(workload="new", step_ms=50.0)]
    comparison = compare(a, b, a_label="before", b_label="after")
    verdicts = {row.key[0]: row.verdict for row in comparison.rows}
    assert verdicts == {"same": "within noise", "slower": "slower", "faster": "faster",
                        "noisy": "within noise", "gone": "only in A", "new": "only in B"}
    rows = {row.key[0]: row for row in comparison.rows}
    assert rows["slower"].delta_pct == pytest.approx(20.0)
    assert rows["slower"].peak_bytes_delta == 3000 * MB - rows["slower"].a.peak_bytes_per_rank
    assert rows["noisy"].noise_band == pytest.approx(0.4)
    assert rows["gone"].b_step_ms is None and rows["gone"].delta_pct is None
    assert rows["new"].a_step_ms is None and rows["new"].b_step_ms == 50.0
    assert [r.key[0] for r in comparison.by_verdict("slower")] == ["slower"]
    assert comparison.a_label == "before"
    with pytest.raises(ValueError) as caught:
        comparison.by_verdict("worse")
    assert_names(str(caught.value), "verdict='worse'")


def test_same_key_twice_uses_the_newest() -> None:
    a = [make_result(step_ms=100.0)]
    b = [make_result(step_ms=500.0, timestamp="2026-11-30T09:00:00+00:00"),
         make_result(step_ms=100.0, timestamp="2026-11-30T08:00:00+00:00")]
    (row,) = compare(a, b).rows
    assert row.b_step_ms == 500.0 and row.verdict == "slower"


def test_a_configurations_own_history_widens_its_band() -> None:
    from dspark.bench.analyse.noise import NoiseModel

    a, b = [make_result(step_ms=100.0, result_id="a")], [make_result(step_ms=125.0, result_id="b")]
    assert compare(a, b).rows[0].verdict == "slower"  # +25% beyond the 15% default
    history = [make_result(step_ms=ms, result_id=f"h{i}", run_id=f"h{i}")
               for i, ms in enumerate((100.0, 130.0))]  # same code, moved by 30% before
    (row,) = compare(a, b, noise=NoiseModel.from_history(history)).rows
    assert row.verdict == "within noise" and row.noise_band == pytest.approx(0.30)
