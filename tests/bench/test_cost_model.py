from __future__ import annotations

import pytest

from dspark.bench.cost_model import cost_model_step_ms, predict_step


def test_compute_share_plus_wire_time() -> None:
    prediction = predict_step(baseline_step_ms=245.0, local_batch=128, global_batch=256,
                              comm_wire_bytes_per_step=100_000_000, bus_bytes_per_s=10e9)
    assert prediction.compute_ms == pytest.approx(122.5)
    assert prediction.comm_ms == pytest.approx(10.0)
    assert cost_model_step_ms(baseline_step_ms=245.0, local_batch=64, global_batch=256,
                              comm_wire_bytes_per_step=0, bus_bytes_per_s=0.0) == pytest.approx(61.25)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"baseline_step_ms": 0.0}, "baseline_step_ms=0.0"),
    ({"local_batch": 0}, "local_batch=0"),
    ({"bus_bytes_per_s": 0.0}, "bus_bytes_per_s=0.0 must be > 0 to time 1000 wire bytes"),
    ({"comm_wire_bytes_per_step": -1}, "comm_wire_bytes_per_step=-1"),
])
def test_bad_inputs_are_named(kwargs: dict[str, float], match: str) -> None:
    values = {"baseline_step_ms": 10.0, "local_batch": 1, "global_batch": 2,
              "comm_wire_bytes_per_step": 1000, "bus_bytes_per_s": 1e9, **kwargs}
    with pytest.raises(ValueError, match=match):
        predict_step(**values)  # type: ignore[arg-type]
