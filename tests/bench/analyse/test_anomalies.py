"""Every anomaly rule on synthetic results: flagged, not flagged, and noisy cases."""

from __future__ import annotations

import dataclasses

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.analyse.anomalies import (
    activation_bytes_per_rank,
    audit_lines,
    is_batch_replicated,
    memory_above_expected,
    reduction_scratch_bytes,
    regression,
    replicated_batch,
)
from dspark.bench.analyse.noise import NoiseModel
from dspark.bench.result import BenchResult
from tests.bench.factory import MB, MODEL_STATE_BYTES, kinds, make_result, seed_results
from tests.messages import assert_line_names, assert_names


def _scaled(result: BenchResult, baseline: BenchResult) -> BenchResult:
    """``result`` with the speedup fields the analysis fills in."""
    return annotate([baseline, result])[1]


GRAD = 102 * MB


# -- replicated_batch: measured, never the label -----------------------------------------------

def test_replicated_batch_says_what_the_ranks_received() -> None:
    one, bug, fixed = seed_results()
    (found,) = replicated_batch(bug, one)
    assert found["message"].startswith("ranks 0 and 1 "), found["message"]
    assert_line_names(found["message"], "same batch", "equal fingerprints", "ranks 0 and 1",
                      "256 samples per step", "2.0x", "1/2 share", "global batch of 256")
    assert_line_names(found["message"], "2.0x", "activation memory", "2000.0 MB", "1000.0 MB")
    # the cause names its fixes: a REPLICATE/None placement, a per-rank sampler, the data seed
    assert_line_names(found["message"], "likely cause", "REPLICATE", "None", "per-rank sampler",
                      "seed")
    assert found["identical_input_ranks"] == [[0, 1]]
    assert replicated_batch(fixed, one) == []


def test_the_configuration_label_decides_nothing() -> None:
    one = make_result()
    # Labelled "replicate" but the probe measured a split batch: nothing to flag.
    assert replicated_batch(make_result(num_devices=2, batch_placement="replicate"), one) == []
    # Labelled "shard" but the probe saw equal batches: flagged, with the same cause.
    labelled_shard = make_result(num_devices=2, identical_input_ranks=[[0, 1]],
                                 samples_by_rank=[128, 128])
    (found,) = replicated_batch(labelled_shard, one)
    assert_line_names(found["message"], "ranks 0 and 1", "same batch")
    assert "replicate'" not in found["message"]


def test_one_rank_taking_the_whole_batch_is_flagged() -> None:
    # Rank 0 took its half, rank 1 the whole batch: the batches differ, rank 1 is over its share.
    lopsided = make_result(num_devices=2, samples_by_rank=[128, 256], local_batch=256)
    (found,) = replicated_batch(lopsided, None)
    assert found["message"].startswith("rank 1's model"), found["message"]
    assert_line_names(found["message"], "256 samples per step", "2.0x", "1/2 share")
    assert_names(found["message"], "more than its slice")
    assert "rank 0's" not in found["message"] and "activation_ratio" not in found


def test_a_replication_inside_the_model_is_flagged() -> None:
    inside = make_result(num_devices=2, replicated_modules=["body"], replicated_module_count=4)
    assert is_batch_replicated(inside)
    (found,) = replicated_batch(inside, None)
    assert_line_names(found["message"], "inside the model", "'body'", "3 more calls",
                      "same batch-derived input", "model's own inputs differed")
    assert_names(found["message"], "model's code")
    assert not is_batch_replicated(make_result(samples_by_rank=[256]))  # one device: whole batch


# -- memory_above_expected -------------------------------------------------------------------

def test_model_state_above_the_strategy_formula() -> None:
    zero2 = {"num_devices": 2, "strategy": "zero2",
             "model_state_bytes_expected_per_rank": MODEL_STATE_BYTES // 2}
    (found,) = memory_above_expected(make_result(**zero2), make_result())
    assert_line_names(found["message"], "400.0 MB", "model state", "zero2", "200.0 MB", "2.00x",
                      "held whole", "sharded")
    assert found["memory"] == "model_state"
    within = make_result(**{**zero2, "model_state_bytes_per_rank": int(MODEL_STATE_BYTES / 2 * 1.04),
                            "peak_bytes_per_rank": 1200 * MB})
    assert memory_above_expected(within, make_result()) == []
    # Tiny CPU presets: 0.5 MB over a 0.1 MB formula is inside the absolute slack.
    tiny = make_result(model_state_bytes_per_rank=500_000, model_state_bytes_expected_per_rank=100_000,
                       peak_bytes_per_rank=500_000 + 2000 * MB)
    assert memory_above_expected(tiny, None) == []
    assert memory_above_expected(make_result(model_state_bytes_expected_per_rank=0), None) == []


def test_model_state_excess_names_the_parts_that_exceed() -> None:
    # zero3 on 2 ranks with one parameter left gathered: params 150 held (50 needed)
    parts = {"params": [150 * MB, 50 * MB], "grads": [50 * MB, 50 * MB],
             "optimizer": [100 * MB, 100 * MB]}
    result = make_result(num_devices=2, strategy="zero3", model_state_bytes_per_rank=300 * MB,
                         model_state_bytes_expected_per_rank=200 * MB, model_state_parts=parts)
    (found,) = memory_above_expected(result, make_result())
    assert_line_names(found["message"], "(1.50x)", "parameters", "150.0 MB held", "50.0 MB needed")


def test_activations_above_a_sharded_share() -> None:
    one = make_result()  # 2000 MB of activations on 1 device: 1000 MB is a 1/2 share
    heavy = make_result(num_devices=2, peak_bytes_per_rank=MODEL_STATE_BYTES + 1600 * MB)
    assert activation_bytes_per_rank(heavy) == 1600 * MB
    (found,) = memory_above_expected(heavy, one)
    assert found["memory"] == "activations" and found["ratio"] == pytest.approx(1.6)
    assert_line_names(found["message"], "1.6x", "1000.0 MB", "1/2 share")
    light = make_result(num_devices=2, peak_bytes_per_rank=MODEL_STATE_BYTES + 1400 * MB)
    assert memory_above_expected(light, one) == []
    # The replicated batch has its own rule; memory is not flagged twice for it.
    _, bug, _ = seed_results()
    assert memory_above_expected(bug, one) == []


def test_micro_batches_hold_one_pass_of_activations() -> None:
    """GPT-2 124M's 256 as 8 x 32 on 1 device and 4 x 32 per rank on 2: the same activations per
    rank, as measured on one H200 (30.4 GiB at 32 in one pass, 30.9 GiB at 256 as 8 x 32); a rank
    holding twice a pass's is still flagged."""
    one = make_result(workload="gpt2-124m", micro_batches=8)  # 2000 MB of activations
    same = make_result(workload="gpt2-124m", num_devices=2, micro_batches=4,
                       peak_bytes_per_rank=MODEL_STATE_BYTES + 2000 * MB)
    assert memory_above_expected(same, one) == []
    double = make_result(workload="gpt2-124m", num_devices=2, micro_batches=4,
                         peak_bytes_per_rank=MODEL_STATE_BYTES + 4000 * MB)
    (found,) = memory_above_expected(double, one)
    assert found["ratio"] == pytest.approx(2.0)
    # 8 GPUs: a rank's 32 in one pass, the same pass as the 1-device run's
    eight = make_result(workload="gpt2-124m", num_devices=8, micro_batches=1,
                        peak_bytes_per_rank=MODEL_STATE_BYTES + 2000 * MB)
    assert memory_above_expected(eight, one) == []
    # without micro-batches the rule is what it was: a 1/N share of the 1-device activations
    assert memory_above_expected(make_result(num_devices=2,
                                             peak_bytes_per_rank=MODEL_STATE_BYTES + 2000 * MB),
                                 make_result())


def test_a_sample_per_rank_may_peak_with_the_reduction_scratch() -> None:
    """gpt2-cpu in fp32 at global batch 2 on 2 ranks, as measured (see [Note: activation bytes]):
    12.2 MB beside 59.5 MB of model state (14.9 MB of it gradients), against 8.7 MB on 1 device.
    Flagged before; a rank holding the whole batch of 8 (79.6 MB) is still flagged."""
    parts = {"params": [14_900_000] * 2, "grads": [14_900_000] * 2,
             "optimizer": [29_700_000] * 2}
    state = 59_500_000

    def run(devices: int, activations: float, strategy: str = "replicate") -> BenchResult:
        return make_result(num_devices=devices, strategy=strategy, model_state_parts=parts,
                           model_state_bytes_per_rank=state,
                           model_state_bytes_expected_per_rank=state,
                           peak_bytes_per_rank=state + int(activations * MB))

    assert memory_above_expected(run(2, 12.2), run(1, 8.7)) == []
    assert reduction_scratch_bytes(run(2, 12.2)) == 14_900_000
    assert reduction_scratch_bytes(run(1, 8.7)) == 0
    (found,) = memory_above_expected(run(2, 79.6), run(1, 79.6))
    assert found["memory"] == "activations"
    assert memory_above_expected(run(2, 39.4), run(1, 79.6)) == []
    # zero2 keeps half the gradients between steps, but reduces all of them.
    half = {**parts, "grads": [7_450_000] * 2}
    assert reduction_scratch_bytes(make_result(num_devices=2, strategy="zero2",
                                               model_state_parts=half)) == 14_900_000


def test_sharded_parts_held_whole_during_a_step_are_not_activations() -> None:
    one = make_result(strategy="zero3")  # 2000 MB of activations on 1 device
    parts = {"params": [50 * MB, 50 * MB], "grads": [50 * MB, 50 * MB],
             "optimizer": [100 * MB, 100 * MB]}
    # 1000 MB of activations + the other rank's halves of params and grads (100 MB), whole for a while
    for strategy, flagged in (("zero3", False), ("torch-fsdp2", False), ("replicate", True)):
        result = make_result(num_devices=2, strategy=strategy, model_state_parts=parts,
                             model_state_bytes_per_rank=200 * MB,
                             model_state_bytes_expected_per_rank=200 * MB,
                             peak_bytes_per_rank=200 * MB + 1000 * MB * 3 // 2 + 100 * MB)
        assert bool(memory_above_expected(result, one)) == flagged, strategy


# -- regression ------------------------------------------------------------------------------

def test_regression_beyond_noise_with_what_changed() -> None:
    old = make_result(run_id="run-old", git_commit="a" * 40, torch_version="2.12.0")
    new = make_result(run_id="run-new", step_ms=290.0, round_step_ms=[290.0] * 3,
                      git_commit="b" * 40, torch_version="2.13.0")
    (found,) = regression(new, old)
    assert_line_names(found["message"], "step time rose 18.4%", "run run-old", "290 ms", "245 ms",
                      "noise band of 15.0%", "15% default")
    assert "what changed: commit" in found["message"] and "15% default" in found["noise_band_source"]
    assert "PyTorch '2.12.0' -> '2.13.0'" in found["message"]
    assert found["previous_result_id"] == old.result_id


def test_a_regression_names_a_changed_malloc_and_optimizer_kernel() -> None:
    # DSPARK_CPU_MALLOC=lean trades speed for memory on the same commit: that is the cause to name,
    # not "load on the machine"
    old = make_result(run_id="run-old", cpu_malloc="dspark", optimizer_kernel="fused")
    new = make_result(run_id="run-new", step_ms=330.0, round_step_ms=[330.0] * 3,
                      cpu_malloc="dspark lean", optimizer_kernel="for-loop")
    (found,) = regression(new, old)
    assert_line_names(found["message"], "CPU malloc", "'dspark' -> 'dspark lean'", "optimizer kernel",
                      "'fused' -> 'for-loop'")
    assert "load on the machine" not in found["message"]


def test_same_code_reruns_within_the_machines_range_are_not_regressions() -> None:
    # Before: a 10% floor under a 14% run-to-run range called same-code reruns slower.
    old = make_result(run_id="run-old", result_id="run-old/x")
    rerun = make_result(run_id="run-new", result_id="run-new/x", step_ms=280.0,
                        round_step_ms=[280.0] * 3)
    assert regression(rerun, old) == []  # +14.3% < the 15% default range
    # A configuration whose own same-code history moved by 30% gets that band.
    history = [make_result(run_id=f"h{i}", result_id=f"h{i}/x", step_ms=ms)
               for i, ms in enumerate((245.0, 318.0))]
    noise = NoiseModel.from_history(history)
    slower = dataclasses.replace(rerun, step_ms=310.0, round_step_ms=[310.0] * 3)
    assert kinds(dataclasses.replace(slower, anomalies=regression(slower, old))) == ["regression"]
    assert regression(slower, old, noise) == []


def test_regression_ignores_noise_improvements_and_first_runs() -> None:
    old = make_result(step_ms_p10=220.0, step_ms_p90=270.0)  # steps scatter by 20%
    assert regression(make_result(step_ms=290.0, round_step_ms=[290.0] * 3), old) == []
    assert regression(make_result(step_ms=200.0), make_result()) == []  # faster: not an anomaly
    assert regression(make_result(), None) == []


def test_the_replicated_batch_is_explained_by_the_engines_audit() -> None:
    one, bug, _ = seed_results()
    assert audit_lines(bug, "batch") == []  # no audit taken (an older result, or a peer)
    row = {"name": "input batch", "kind": "batch", "placement": "Replicate()", "bytes": 800,
           "expected_bytes": 400, "factor": 2.0}
    audited = dataclasses.replace(bug, audit_by_rank=[{"rows_checked": 106, "above_share": [row]}] * 2)
    (line,) = audit_lines(audited, "batch")
    assert_line_names(line, "engine.audit() on rank 0", "input batch", "2.0x", "1/2 share", "replicated")
    [found] = replicated_batch(audited, one)
    assert f"; {line};" in found["message"]  # the audit's own line, quoted whole
