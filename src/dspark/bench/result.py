"""What one benchmark configuration is, and what its measurement records.

These two dataclasses are the contract between the runner (which measures), the ledger (which keeps
results, append-only), the analysis (speedup, anomalies) and the reports. ``BenchResult.to_dict``
gives the JSON object ``dspark bench --json`` writes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["BATCH_PLACEMENTS", "BenchConfig", "BenchResult", "ConfigKey"]

BATCH_PLACEMENTS = ("shard", "replicate")

ConfigKey = tuple[str, int, str, str, str, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """One configuration to measure."""

    workload: str
    """Name in ``dspark.models`` (e.g. ``"resnet50-cpu"``)."""
    num_devices: int
    """Ranks (one device each: a GPU, or one CPU core)."""
    strategy: str = "replicate"
    """Engine strategy: replicate, zero1, zero2, zero3."""
    precision: str = "bf16"
    """fp32, fp16 or bf16."""
    batch_placement: str = "shard"
    """``"shard"`` splits the global batch (strong scaling); ``"replicate"`` is the seed's bug, on purpose."""
    global_batch: int = 32
    """Samples per optimizer step, across all ranks."""
    warmup_steps: int = 2
    """Steps run and discarded before timing."""
    measure_steps: int = 5
    """Timed steps; the median and p10/p90 come from these."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices={self.num_devices} must be >= 1")
        if self.batch_placement not in BATCH_PLACEMENTS:
            raise ValueError(f"batch_placement={self.batch_placement!r} is not one of {BATCH_PLACEMENTS}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch={self.global_batch} must be >= 1")
        if self.warmup_steps < 0 or self.measure_steps < 1:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0 and "
                             f"measure_steps={self.measure_steps} >= 1")

    @property
    def key(self) -> ConfigKey:
        """What makes two results comparable (same workload, devices, strategy, ...)."""
        return _key(self)

    @property
    def baseline_key(self) -> ConfigKey:
        """The 1-device configuration this one's speedup is measured against."""
        return _baseline_key(self)

    def config_hash(self) -> str:
        payload = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(kw_only=True, slots=True)
class BenchResult:
    """One measured configuration. Every key of the JSON output is a field here."""

    # what ran
    workload: str
    num_devices: int
    strategy: str
    precision: str
    batch_placement: str
    global_batch: int
    # time
    step_ms: float
    """Median step time (the slowest rank's, devices synchronised)."""
    step_ms_p10: float
    step_ms_p90: float
    samples_per_s: float
    # memory
    peak_bytes_per_rank: int
    """GPU: allocator peak. CPU: tensor bytes the rank held at its peak, measured."""
    model_state_bytes_per_rank: int
    """Parameters + gradients + optimizer state this rank held (measured from the tensors)."""
    # what the runner saw
    local_batch: int
    """Samples each rank actually processed per step (global / N when sharded)."""
    model_state_bytes_expected_per_rank: int = 0
    """What the strategy should hold for parameters + gradients + optimizer state (ZeRO formulas)."""
    model_state_parts: dict[str, list[int]] = field(default_factory=dict)
    """``{"params" | "grads" | "optimizer": [bytes held, bytes the strategy needs]}`` on the rank
    holding the most model state: which tensors exceed the formula when the total does."""
    replicated_inputs: list[str] = field(default_factory=list)
    """Batch tensors each rank held whole although num_devices > 1 (e.g. ``"batch[0]"``)."""
    comm_bytes_per_step: int = 0
    """Collective payload bytes one rank sent per step (from the comm layer's counters)."""
    comm_wire_bytes_per_step: int = 0
    """The same traffic as a ring algorithm puts it on the wire (for the cost model)."""
    bus_bytes_per_s: float = 0.0
    """Collective bandwidth measured on the spot (wire bytes / s of a large all-reduce; 0 with one device)."""
    # scaling, filled by the analysis against the 1-device run
    speedup: float | None = None
    efficiency: float | None = None
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    # provenance
    git_commit: str = ""
    git_dirty: bool = False
    dspark_version: str = ""
    torch_version: str = ""
    python_version: str = ""
    host: str = ""
    device_model: str = ""
    backend: str = ""
    config_hash: str = ""
    timestamp: str = ""
    """UTC, ISO 8601."""
    run_id: str = ""
    """The ``dspark bench`` invocation that produced it."""
    warmup_steps: int = 0
    measure_steps: int = 0

    @property
    def key(self) -> ConfigKey:
        return _key(self)

    @property
    def baseline_key(self) -> ConfigKey:
        return _baseline_key(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _key(item: BenchConfig | BenchResult) -> ConfigKey:
    return (item.workload, item.num_devices, item.strategy, item.precision,
            item.batch_placement, item.global_batch)


def _baseline_key(item: BenchConfig | BenchResult) -> ConfigKey:
    return (item.workload, 1, item.strategy, item.precision, "shard", item.global_batch)
