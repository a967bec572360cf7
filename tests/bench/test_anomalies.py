"""Every anomaly rule on synthetic results: flagged, not flagged, and noisy cases."""

from __future__ import annotations

import pytest

from dspark.bench.anomalies import (
    activation_bytes_per_rank,
    below_cost_model,
    is_batch_replicated,
    memory_above_expected,
    negative_scaling,
    regression,
    replicated_batch,
)
from tests.bench.factory import MB, MODEL_STATE_BYTES, make_result, seed_results


def _noisy(step_ms: float, spread: float, **kw: object) -> dict[str, object]:
    return {"step_ms": step_ms, "step_ms_p10": step_ms * (1 - spread / 2),
            "step_ms_p90": step_ms * (1 + spread / 2), **kw}


# -- negative_scaling ------------------------------------------------------------------------

def test_negative_scaling_flags_the_seed_bug_with_its_cause() -> None:
    one, bug, fixed = seed_results()
    (found,) = negative_scaling(bug, one)
    assert found["message"].startswith("2 devices are 1.14x slower than 1 (280 ms vs 245 ms)")
    assert "batch is replicated on every rank" in found["message"]
    assert found["speedup"] == pytest.approx(245 / 280)
    assert negative_scaling(fixed, one) == []
    assert negative_scaling(one, one) == []
    assert negative_scaling(bug, None) == []


def test_negative_scaling_causes_and_noise() -> None:
    one = make_result()
    # A sharded run barely slower, with noisy steps: still no faster than 1 device, said so.
    (noisy,) = negative_scaling(make_result(num_devices=2, **_noisy(250.0, 0.2)), one)
    assert "within the noise band of 20%" in noisy["message"]
    assert "communication (10.2 ms per step for 102.0 MB on the wire)" in noisy["message"]
    (state,) = negative_scaling(make_result(num_devices=2, step_ms=300.0, strategy="zero2",
                                            model_state_bytes_expected_per_rank=MODEL_STATE_BYTES // 2),
                                one)
    assert "model state is replicated where the zero2 strategy shards it" in state["message"]
    # A healthy speedup whose steps scatter by 30% is not negative scaling.
    assert negative_scaling(make_result(num_devices=2, **_noisy(136.0, 0.3)), one) == []


# -- replicated_batch ------------------------------------------------------------------------

def test_replicated_batch_names_tensors_and_activation_ratio() -> None:
    one, bug, fixed = seed_results()
    (found,) = replicated_batch(bug, one)
    assert ("each rank holds 2.0x the activation memory a sharded batch needs (2000.0 MB vs "
            "1000.0 MB): the batch (batch[0], batch[1]) is replicated on every rank, not split"
            ) in found["message"]
    assert "each rank processed 256 samples of a global batch of 256 (2.0x" in found["message"]
    assert "batch_placement='replicate'" in found["message"]
    assert found["activation_ratio"] == pytest.approx(2.0)
    assert found["replicated_inputs"] == ["batch[0]", "batch[1]"]
    assert replicated_batch(fixed, one) == []


def test_replicated_batch_detected_from_either_signal() -> None:
    one = make_result()
    by_tensor = make_result(num_devices=2, replicated_inputs=["batch['tokens']"])
    (found,) = replicated_batch(by_tensor, one)
    assert "(batch['tokens'])" in found["message"]
    assert "shard_dim=REPLICATE or None upstream" in found["message"]
    by_count = make_result(num_devices=2, local_batch=256)
    (found,) = replicated_batch(by_count, None)  # no baseline: no memory ratio, still flagged
    assert "(every batch tensor)" in found["message"] and "activation_ratio" not in found
    # One device holds the whole batch by definition.
    assert not is_batch_replicated(make_result(local_batch=256))


# -- memory_above_expected -------------------------------------------------------------------

def test_model_state_above_the_strategy_formula() -> None:
    zero2 = {"num_devices": 2, "strategy": "zero2",
             "model_state_bytes_expected_per_rank": MODEL_STATE_BYTES // 2}
    (found,) = memory_above_expected(make_result(**zero2), make_result())
    assert found["message"] == ("rank holds 400.0 MB of model state, the zero2 strategy needs "
                                "200.0 MB (2.00x): a tensor is replicated where it should be "
                                "sharded")
    assert found["memory"] == "model_state"
    within = make_result(**{**zero2, "model_state_bytes_per_rank": int(MODEL_STATE_BYTES / 2 * 1.04),
                            "peak_bytes_per_rank": 1200 * MB})
    assert memory_above_expected(within, make_result()) == []
    # Tiny CPU presets: 0.5 MB over a 0.1 MB formula is inside the absolute slack.
    tiny = make_result(model_state_bytes_per_rank=500_000, model_state_bytes_expected_per_rank=100_000,
                       peak_bytes_per_rank=500_000 + 2000 * MB)
    assert memory_above_expected(tiny, None) == []
    assert memory_above_expected(make_result(model_state_bytes_expected_per_rank=0), None) == []


def test_model_state_excess_names_the_tensors_that_exceed() -> None:
    # zero2 on 2 ranks with gradients left whole: params 100 (100), grads 100 (50), optimizer 100 (100)
    parts = {"params": [100 * MB, 100 * MB], "grads": [100 * MB, 50 * MB],
             "optimizer": [100 * MB, 100 * MB]}
    result = make_result(num_devices=2, strategy="zero2", model_state_bytes_per_rank=300 * MB,
                         model_state_bytes_expected_per_rank=250 * MB, model_state_parts=parts)
    (found,) = memory_above_expected(result, make_result())
    assert found["message"].endswith(
        "(1.20x): the gradients (100.0 MB held, 50.0 MB needed) held whole where the strategy "
        "shards them"), found["message"]


def test_activations_above_a_sharded_share() -> None:
    one = make_result()  # 2000 MB of activations on 1 device: 1000 MB is a 1/2 share
    heavy = make_result(num_devices=2, peak_bytes_per_rank=MODEL_STATE_BYTES + 1600 * MB)
    assert activation_bytes_per_rank(heavy) == 1600 * MB
    (found,) = memory_above_expected(heavy, one)
    assert found["memory"] == "activations" and found["ratio"] == pytest.approx(1.6)
    assert "1.6x the 1000.0 MB a 1/2 share" in found["message"]
    light = make_result(num_devices=2, peak_bytes_per_rank=MODEL_STATE_BYTES + 1400 * MB)
    assert memory_above_expected(light, one) == []
    # The replicated batch has its own rule; memory is not flagged twice for it.
    _, bug, _ = seed_results()
    assert memory_above_expected(bug, one) == []


# -- below_cost_model ------------------------------------------------------------------------

def test_below_cost_model() -> None:
    one = make_result()
    slow = make_result(num_devices=2, step_ms=200.0)  # model: 122.5 + 10.2 = 132.7 ms
    (found,) = below_cost_model(slow, one)
    assert found["predicted_step_ms"] == pytest.approx(132.7)
    assert found["message"].startswith(
        "2 devices reach 1.23x (efficiency 61%), the cost model predicts 1.85x (92%): measured "
        "200 ms vs predicted 133 ms = 122 ms compute (128/256 of the 245 ms 1-device step) + "
        "10.2 ms communication (102.0 MB on the wire at 10.00 GB/s; 8% of the prediction)")
    assert below_cost_model(make_result(num_devices=2, step_ms=136.0), one) == []
    assert below_cost_model(make_result(num_devices=2, step_ms=170.0), one) == []  # 1.28x model
    assert below_cost_model(make_result(num_devices=2, step_ms=200.0, bus_bytes_per_s=0.0),
                            one) == []
    assert below_cost_model(one, one) == []


# -- regression ------------------------------------------------------------------------------

def test_regression_beyond_noise_with_what_changed() -> None:
    old = make_result(run_id="run-old", git_commit="a" * 40, torch_version="2.12.0")
    new = make_result(run_id="run-new", step_ms=280.0, git_commit="b" * 40,
                      torch_version="2.13.0")
    (found,) = regression(new, old)
    assert found["message"].startswith("step time rose 14.3% since run run-old (280 ms vs 245 ms),"
                                       " beyond the noise band of 10.0%; what changed: commit")
    assert "PyTorch '2.12.0' -> '2.13.0'" in found["message"]
    assert found["previous_run_id"] == "run-old"
    same_code = make_result(run_id="run-new", step_ms=280.0)
    (found,) = regression(same_code, make_result(run_id="run-old"))
    assert "nothing recorded changed" in found["message"]


def test_regression_ignores_noise_improvements_and_first_runs() -> None:
    old = make_result(**_noisy(245.0, 0.2))
    assert regression(make_result(**_noisy(280.0, 0.2)), old) == []  # +14% inside a 20% spread
    assert regression(make_result(step_ms=200.0), make_result()) == []  # faster: not an anomaly
    assert regression(make_result(step_ms=255.0), make_result()) == []  # +4%: under the floor
    assert regression(make_result(), None) == []
