from __future__ import annotations

import pytest

from dspark.bench.noise import NOISE_FLOOR, noise_band, relative_spread, timing_verdict
from dspark.bench.result import BenchResult
from tests.bench.factory import make_result


def _run(step_ms: float, spread: float = 0.0) -> BenchResult:
    return make_result(step_ms=step_ms, step_ms_p10=step_ms * (1 - spread / 2),
                       step_ms_p90=step_ms * (1 + spread / 2))


def test_spread_and_band() -> None:
    assert relative_spread(_run(100.0, 0.08)) == pytest.approx(0.08)
    assert relative_spread(make_result(step_ms=0.0, step_ms_p10=0.0, step_ms_p90=0.0,
                                       samples_per_s=0.0)) == 0.0
    assert noise_band(_run(100.0), _run(100.0)) == NOISE_FLOOR
    assert noise_band(_run(100.0, 0.02), _run(100.0, 0.20)) == pytest.approx(0.20)


@pytest.mark.parametrize(("old", "new", "verdict"), [
    (_run(245.0), _run(280.0), "slower"),                  # +14% on steady runs
    (_run(245.0), _run(265.0), "within noise"),            # +8% < the 10% floor
    (_run(245.0, 0.20), _run(280.0, 0.20), "within noise"),  # +14% but steps scatter by 20%
    (_run(280.0), _run(245.0), "faster"),
    (_run(100.0, 0.30), _run(70.0), "faster"),            # 100/70 = 1.43 > 1.30
    (_run(100.0, 0.50), _run(70.0), "within noise"),
])
def test_verdict(old: BenchResult, new: BenchResult, verdict: str) -> None:
    assert timing_verdict(old, new) == verdict
