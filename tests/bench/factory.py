"""Synthetic benchmark results and measurements shaped like the seed's (ResNet-50, global batch
256): no process group, no model, just the numbers the analysis and the ledger read."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dspark.bench.ledger.measurement import Measurement, results_from_measurements
from dspark.bench.measure.runner import RunFailure
from dspark.bench.result import BenchConfig, BenchResult

if TYPE_CHECKING:
    from dspark.bench.ledger.ledger import Ledger

MB = 1_000_000
MODEL_STATE_BYTES = 400 * MB      # params + grads + AdamW state, replicate strategy: same on every rank
ONE_DEVICE_ACTIVATION_BYTES = 2000 * MB
GRAD_WIRE_BYTES = 102 * MB        # ring all-reduce of ~102 MB of fp32 grads on 2 ranks
BUS_BYTES_PER_S = 10e9
COMMIT = "1e5fe8e01ae526ecb264d4b703095e4a7abb7127"


def make_result(**overrides: Any) -> BenchResult:
    """A healthy 1-device result at 245 ms unless overridden: 3 steady rounds at ``step_ms``
    (override ``round_step_ms`` for others), p10/p90 at -/+2% of step_ms, every rank's model
    given its share of the batch, nothing else running on the cores."""
    step_ms = overrides.get("step_ms", 245.0)
    num_devices = overrides.get("num_devices", 1)
    rounds = overrides.get("round_step_ms", [step_ms] * 3)
    run_id = overrides.get("run_id", "run-a")
    name = (f"{overrides.get('workload', 'resnet50')}-{num_devices}-"
            f"{overrides.get('batch_placement', 'shard')}-{overrides.get('strategy', 'replicate')}")
    values: dict[str, Any] = {
        "workload": "resnet50", "num_devices": num_devices, "strategy": "replicate",
        "precision": "fp16", "batch_placement": "shard", "global_batch": 256,
        "step_ms": step_ms, "step_ms_p10": step_ms * 0.98, "step_ms_p90": step_ms * 1.02,
        "samples_per_s": 256 / step_ms * 1e3 if step_ms > 0 else 0.0,
        "peak_bytes_per_rank": MODEL_STATE_BYTES + ONE_DEVICE_ACTIVATION_BYTES // num_devices,
        "model_state_bytes_per_rank": MODEL_STATE_BYTES,
        "model_state_bytes_expected_per_rank": MODEL_STATE_BYTES,
        "local_batch": 256 // num_devices, "samples_by_rank": [256 // num_devices] * num_devices,
        "batch_inspected": True,
        "result_id": f"{run_id}/{name}", "rounds": len(rounds),
        "round_indices": list(range(len(rounds))), "round_step_ms": list(rounds),
        "core_foreign_share_by_round": [0.01] * len(rounds), "ranks_pinned": True,
        "comm_bytes_per_step": GRAD_WIRE_BYTES if num_devices > 1 else 0,
        "comm_wire_bytes_per_step": GRAD_WIRE_BYTES if num_devices > 1 else 0,
        "bus_bytes_per_s": BUS_BYTES_PER_S if num_devices > 1 else 0.0,
        "git_commit": COMMIT, "host": "box", "run_id": run_id,
        "timestamp": "2026-11-30T05:00:00+00:00", "warmup_steps": 2, "measure_steps": 5,
    }
    values.update(overrides)
    return BenchResult(**values)


def seed_results(workload: str = "resnet50", one_ms: float = 245.0, bug_ms: float = 280.0,
                 fixed_ms: float = 130.0) -> list[BenchResult]:
    """The article's three runs: 1 device; 2 devices whose models received the same whole batch
    (as the batch probe measures it); 2 sharded."""
    one = make_result(workload=workload, step_ms=one_ms)
    bug = make_result(workload=workload, num_devices=2, step_ms=bug_ms,
                      batch_placement="replicate", local_batch=256, samples_by_rank=[256, 256],
                      identical_input_ranks=[[0, 1]],
                      peak_bytes_per_rank=MODEL_STATE_BYTES + ONE_DEVICE_ACTIVATION_BYTES)
    fixed = make_result(workload=workload, num_devices=2, step_ms=fixed_ms)
    return [one, bug, fixed]


def make_measurement(**overrides: Any) -> Measurement:
    """One round of a healthy 2-device gpt2-cpu configuration, every field set plausibly."""
    values: dict[str, Any] = {
        "workload": "gpt2-cpu", "num_devices": 2, "strategy": "replicate", "precision": "bf16",
        "batch_placement": "shard", "global_batch": 8, "warmup_steps": 2, "measure_steps": 3,
        "run_id": "run-a", "round_index": 0,
        "step_ms_by_rank": [[100.0, 110.0, 105.0], [101.0, 108.0, 120.0]],
        "rank_loads": [
            {"rank": r, "core": r, "window_s": 0.4, "own_cpu_s": 0.35, "foreign_cpu_s": 0.004,
             "steal_s": 0.0, "machine_busy_s": 0.72, "threads": 4, "threads_pinned": 4}
            for r in range(2)],
        "tensor_peak_bytes_by_rank": [90 * MB, 91 * MB], "rss_peak_bytes_by_rank": [400 * MB, 410 * MB],
        "rss_scope": "timed steps",
        "state_held_by_rank": [{"params": 15 * MB, "grads": 15 * MB, "optimizer": 30 * MB,
                                "buffers": 1000}] * 2,
        "state_expected_by_rank": [{"params": 15 * MB, "grads": 15 * MB, "optimizer": 30 * MB}] * 2,
        "batch": {"samples_by_rank": [4, 4], "identical_input_ranks": [],
                  "replicated_modules": [], "replicated_module_count": 0},
        "comm_bytes_per_step": 15 * MB, "comm_wire_bytes_per_step": 15 * MB,
        "bus_bytes_per_s": 1e9, "buffer_sync": "none (broadcast once at construction)",
        "git_commit": COMMIT, "dspark_version": "0.1.0", "torch_version": "2.13.0",
        "python_version": "3.11.7", "host": "box", "device_model": "cpu", "backend": "gloo",
        "timestamp": "2026-11-30T05:00:00+00:00",
    }
    values.update(overrides)
    made = Measurement(**values)
    # the hash of the configuration it holds, as the worker writes it (the ledger's chain checks it)
    return made if "config_hash" in overrides else dataclasses.replace(
        made, config_hash=made.config.config_hash())


def phase_stats(compute: list[float], wait: float = 2.0) -> dict[str, list[float]]:
    """One rank's ``engine.step_stats()`` over its timed steps, key by key: ``compute`` split
    1 : 2 : 0.1 between forward, backward and optimizer, plus ``wait`` ms of exposed communication."""
    forward = [c / 3.1 for c in compute]
    return {"step_ms": [c + wait + 1.0 for c in compute], "forward_ms": forward,
            "backward_ms": [2 * f for f in forward], "comm_exposed_ms": [wait] * len(compute),
            "optimizer_ms": [0.1 * f for f in forward], "data_ms": [0.5] * len(compute),
            "compute_ms": list(compute)}


def profiled_result(compute_by_rank: list[list[float]], *, waits: list[float] | None = None,
                    **overrides: Any) -> BenchResult:
    """A one-round result of ``dspark bench --profile`` whose rank ``r`` (on host ``box{r}``)
    computed ``compute_by_rank[r]`` ms in its timed steps."""
    waits = waits or [2.0] * len(compute_by_rank)
    m = make_measurement(profiled=True, hosts_by_rank=[f"box{r}" for r in range(len(compute_by_rank))],
                         phase_ms_by_rank=[phase_stats(c, w)
                                           for c, w in zip(compute_by_rank, waits, strict=True)],
                         **overrides)
    return results_from_measurements([m])[0]


class FakeWorkers:
    """Stands in for run_in_workers: steps of 200 / N ms (+ the round index), a record of the
    calls, a configuration that fails, or an interrupt after ``crash_at`` launches; ``fields``
    override the measurements' other fields (e.g. the host)."""

    def __init__(self, *, fail: BenchConfig | None = None, crash_at: int | None = None,
                 **fields: Any) -> None:
        self.calls: list[tuple[BenchConfig, int, bool]] = []
        self.options: list[dict[str, Any]] = []  # profile and trace_dir of each call
        self.fail, self.crash_at, self.fields = fail, crash_at, fields

    def __call__(self, config: BenchConfig, *, round_index: int = 0, probe: bool = True,
                 **options: Any) -> Measurement | RunFailure:
        self.calls.append((config, round_index, probe))
        self.options.append(options)
        if self.crash_at is not None and len(self.calls) > self.crash_at:
            raise KeyboardInterrupt  # the user gave up, or the machine went down
        if config == self.fail:
            return RunFailure(config=config, exit_code=1, stderr_tail="RuntimeError: boom")
        ms = 200.0 / config.num_devices + round_index
        return make_measurement(**{**dataclasses.asdict(config), "run_id": "",
                                   "round_index": round_index,
                                   "step_ms_by_rank": [[ms] * config.measure_steps] * config.num_devices,
                                   "config_hash": config.config_hash(), **self.fields})


def kinds(result: BenchResult) -> list[str]:
    return [a["kind"] for a in result.anomalies]


RUN_ROUNDS = 3
"""The rounds of :func:`append_run`."""


def append_run(ledger: Ledger, *, busy: bool = False) -> None:
    """A 3-round run: 1 device at ~460 ms, 2 devices at ~240 ms, interleaved."""
    rows = []
    for r in range(RUN_ROUNDS):
        one = make_measurement(num_devices=1, round_index=r, rounds_planned=RUN_ROUNDS,
                               step_ms_by_rank=[[460.0 + r, 462.0, 461.0]],
                               rank_loads=make_measurement().rank_loads[:1],
                               batch={"samples_by_rank": [8], "identical_input_ranks": [],
                                      "replicated_modules": [], "replicated_module_count": 0},
                               state_held_by_rank=make_measurement().state_held_by_rank[:1],
                               state_expected_by_rank=make_measurement().state_expected_by_rank[:1],
                               tensor_peak_bytes_by_rank=[150_000_000],
                               rss_peak_bytes_by_rank=[500_000_000])
        loads = [dict(load, foreign_cpu_s=0.2 if busy else 0.004)
                 for load in make_measurement().rank_loads]
        two = make_measurement(round_index=r, rounds_planned=RUN_ROUNDS, rank_loads=loads,
                               step_ms_by_rank=[[240.0 + r, 241.0, 242.0]] * 2)
        rows += [one, two]
    ledger.append(rows)
