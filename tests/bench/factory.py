"""Synthetic benchmark results shaped like the seed's (ResNet-50, global batch 256): no process
group, no model, just the numbers the analysis reads."""

from __future__ import annotations

from typing import Any

from dspark.bench.result import BenchResult

MB = 1_000_000
MODEL_STATE_BYTES = 400 * MB      # params + grads + AdamW state, replicate strategy: same on every rank
ONE_DEVICE_ACTIVATION_BYTES = 2000 * MB
GRAD_WIRE_BYTES = 102 * MB        # ring all-reduce of ~102 MB of fp32 grads on 2 ranks
BUS_BYTES_PER_S = 10e9


def make_result(**overrides: Any) -> BenchResult:
    """A healthy 1-device result at 245 ms unless overridden; p10/p90 at -/+2% of step_ms."""
    step_ms = overrides.get("step_ms", 245.0)
    num_devices = overrides.get("num_devices", 1)
    values: dict[str, Any] = {
        "workload": "resnet50", "num_devices": num_devices, "strategy": "replicate",
        "precision": "fp16", "batch_placement": "shard", "global_batch": 256,
        "step_ms": step_ms, "step_ms_p10": step_ms * 0.98, "step_ms_p90": step_ms * 1.02,
        "samples_per_s": 256 / step_ms * 1e3 if step_ms > 0 else 0.0,
        "peak_bytes_per_rank": MODEL_STATE_BYTES + ONE_DEVICE_ACTIVATION_BYTES // num_devices,
        "model_state_bytes_per_rank": MODEL_STATE_BYTES,
        "model_state_bytes_expected_per_rank": MODEL_STATE_BYTES,
        "local_batch": 256 // num_devices,
        "comm_wire_bytes_per_step": GRAD_WIRE_BYTES if num_devices > 1 else 0,
        "bus_bytes_per_s": BUS_BYTES_PER_S if num_devices > 1 else 0.0,
        "git_commit": "1e5fe8e01ae526ecb264d4b703095e4a7abb7127", "run_id": "run-a",
        "timestamp": "2026-11-30T05:00:00+00:00", "warmup_steps": 2, "measure_steps": 5,
    }
    values.update(overrides)
    return BenchResult(**values)


def seed_results(workload: str = "resnet50", one_ms: float = 245.0, bug_ms: float = 280.0,
                 fixed_ms: float = 130.0) -> list[BenchResult]:
    """The article's three runs: 1 device; 2 devices with the batch replicated; 2 sharded."""
    one = make_result(workload=workload, step_ms=one_ms)
    bug = make_result(workload=workload, num_devices=2, step_ms=bug_ms,
                      batch_placement="replicate", local_batch=256,
                      peak_bytes_per_rank=MODEL_STATE_BYTES + ONE_DEVICE_ACTIVATION_BYTES,
                      replicated_inputs=["batch[0]", "batch[1]"])
    fixed = make_result(workload=workload, num_devices=2, step_ms=fixed_ms)
    return [one, bug, fixed]


def kinds(result: BenchResult) -> list[str]:
    return [a["kind"] for a in result.anomalies]
