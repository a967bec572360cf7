"""What one benchmark configuration is, and what a run measured for it.

``BenchConfig`` is what to measure. The ledger keeps raw measurements, one per launch
(:class:`dspark.bench.ledger.measurement.Measurement`); a ``BenchResult`` is one configuration of one run,
summarised from its rounds when read, and carries the analysis (speedup, anomalies) computed then,
so a corrected rule reaches old results. ``BenchResult.to_dict`` gives the JSON object
``dspark bench --json`` writes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

__all__ = ["BATCH_PLACEMENTS", "BenchConfig", "BenchResult", "ConfigKey", "Recorded"]

BATCH_PLACEMENTS = ("shard", "replicate")

ConfigKey = tuple[str, int, str, str, str, int]

_R = TypeVar("_R", bound="Recorded")


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
    max_micro_batch: int | None = None
    """Samples one rank runs in one forward/backward pass at most (``dspark bench --micro-batch``);
    ``None``: the workload's own limit (:attr:`dspark.models.Workload.max_micro_batch`)."""

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
        if self.max_micro_batch is not None and (isinstance(self.max_micro_batch, bool)
                                                 or self.max_micro_batch < 1):
            raise ValueError(f"max_micro_batch={self.max_micro_batch!r} must be None or >= 1")

    @property
    def key(self) -> ConfigKey:
        """What makes two results comparable (same workload, devices, strategy, ...)."""
        return _key(self)

    @property
    def baseline_key(self) -> ConfigKey:
        """The 1-device configuration this one's speedup is measured against."""
        return _baseline_key(self)

    @property
    def slug(self) -> str:
        """A name for the configuration's files (``dspark bench --trace DIR`` writes to
        ``DIR/<slug>/``): the comparable fields, joined safely for a path.

        Example::

            BenchConfig(workload="gpt2-cpu", num_devices=2).slug   # "gpt2-cpu-2dev-replicate-bf16-shard32"
        """
        return (f"{self.workload}-{self.num_devices}dev-{self.strategy}-{self.precision}-"
                f"{self.batch_placement}{self.global_batch}")

    def config_hash(self) -> str:
        fields_ = asdict(self)
        if fields_["max_micro_batch"] is None:  # left out: a configuration keeps its earlier hash
            del fields_["max_micro_batch"]
        payload = json.dumps(fields_, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True, slots=True)
class Recorded:
    """Where a figure came from (see :mod:`dspark.bench.measure.provenance`), and the JSON round trip
    shared by raw measurements and results."""

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
    """UTC, ISO 8601 (of the first round, for a result)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls: type[_R], data: dict[str, Any]) -> _R:
        """The value of ``data``'s known keys (unknown ones, e.g. from a newer DSpark, are dropped)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchResult(Recorded):
    """One configuration measured in one run: its rounds' raw figures, summarised, plus the analysis
    (speedup, anomalies) computed when it is read (see :mod:`dspark.bench.analyse.analysis`). Every key of
    the JSON output is a field here."""

    # what ran
    workload: str
    num_devices: int
    strategy: str
    precision: str
    batch_placement: str
    global_batch: int
    # time
    step_ms: float
    """Median of every timed step of every round (a step's time is its slowest rank's)."""
    step_ms_p10: float
    step_ms_p90: float
    samples_per_s: float
    """The samples a step trained (``samples_per_step``, or ``global_batch`` when not counted)
    over the median step (see [Note: samples counted] in :mod:`dspark.bench.analyse.samples`)."""
    # memory
    peak_bytes_per_rank: int
    """GPU: allocator peak. CPU: tensor bytes the rank held at its peak during one training step
    (storages Python reaches, plus the allocations the profiler saw); not C++-only buffers."""
    model_state_bytes_per_rank: int
    """Parameters + gradients + optimizer state the heaviest rank held, found by walking what the
    module and the optimizer reference (see :mod:`dspark.bench.measure.model_state`)."""
    local_batch: int
    """The most samples any rank's model received per step (measured by the batch probe, over
    every pass of the step)."""
    result_id: str = ""
    """``<run id>/<config hash>``: what an N-device result names as its baseline."""
    rounds: int = 1
    """Launches of this configuration in the run, interleaved with its baseline's."""
    round_indices: list[int] = field(default_factory=list)
    step_ms_by_round: list[list[float]] = field(default_factory=list)
    """Every timed step (the slowest rank's), per round: the raw samples."""
    round_step_ms: list[float] = field(default_factory=list)
    """The median step of each round."""
    peak_rss_bytes_per_rank: int = 0
    """The largest peak resident memory of a rank's process: everything it touched, C++ and the
    PyTorch libraries included (the span is ``rss_scope``)."""
    rss_scope: str = ""
    model_state_bytes_expected_per_rank: int = 0
    """What the strategy should hold for parameters + gradients + optimizer state (ZeRO formulas),
    on the rank that held the most."""
    model_state_parts: dict[str, list[int]] = field(default_factory=dict)
    """``{"params" | "grads" | "optimizer": [bytes held, bytes the strategy needs]}`` on the rank
    holding the most model state."""
    buffer_bytes_per_rank: int = 0
    """Module buffers (never sharded), beside the model state."""
    batch_inspected: bool = False
    """Whether the batch probe ran (it does in the first round of a configuration)."""
    samples_by_rank: list[int] = field(default_factory=list)
    """Samples each rank's model received per step."""
    samples_per_step: int = 0
    """Samples one step trained by the probe's count (their sum, at most the global batch); 0 when
    not counted."""
    identical_input_ranks: list[list[int]] = field(default_factory=list)
    """Pairs of ranks whose models received the same batch."""
    replicated_modules: list[str] = field(default_factory=list)
    """Modules that received the same batch-derived input on two ranks whose model inputs
    differed: a replication inside the model's code."""
    replicated_module_count: int = 0
    core_foreign_share_by_round: list[float | None] = field(default_factory=list)
    """Per round, the largest share of a rank's timed window its core spent on other processes
    (or stolen by the hypervisor); None where the kernel's counters are unavailable."""
    machine_foreign_cores_by_round: list[float | None] = field(default_factory=list)
    """Per round, cores' worth of other processes' work on the whole machine during the window."""
    core_foreign_share_by_rank: list[float | None] = field(default_factory=list)
    """Per rank, the largest share of its timed windows (over the rounds) its core spent on other
    processes or stolen; None where the kernel's counters are unavailable."""
    threads_unpinned: int = 0
    """Threads of a rank that were not pinned to its core (0 when every thread was)."""
    ranks_pinned: bool = False
    comm_bytes_per_step: int | None = None
    """Collective payload bytes one rank sent per step, counted by DSpark's comm layer; None when
    not measured (PyTorch's peers bypass the counters)."""
    comm_wire_bytes_per_step: int | None = None
    """The same traffic as a ring algorithm puts it on the wire (for the cost model)."""
    estimated_comm_bytes_per_step: int | None = None
    """Peers only: the payload their algorithm implies, ESTIMATED from the parameter sizes."""
    estimated_comm_wire_bytes_per_step: int | None = None
    bus_bytes_per_s: float = 0.0
    """Collective bandwidth measured on the spot (median over rounds; 0 with one device)."""
    buffer_sync: str = ""
    """How module buffers were kept equal across ranks (the same policy for DSpark and DDP)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the engine was built with beyond the configuration; for a DeepSpeed peer,
    the DeepSpeed configuration (``deepspeed_config``) and version."""
    optimizer_kernel: str = ""
    """The kernel the optimizer stepped with: ``fused``, ``foreach`` or ``for-loop`` (DSpark's
    engine turns on the fused one; see dspark.policy.optimizer_kernel); "" when not recorded."""
    micro_batches: int = 1
    """Forward/backward passes per rank per step: the local batch in equal micro-batches of at
    most the workload's ``max_micro_batch`` (gradients accumulated, one optimizer step)."""
    max_micro_batch: int | None = None
    """The limit asked with ``dspark bench --micro-batch``; None: the workload's own."""
    cpu_malloc: str = ""
    """How the workers' malloc was set on a CPU device (:mod:`dspark.cpu_malloc`): ``dspark``, or
    ``default (<why>)`` (PyTorch's peers run with glibc's own, as their users do); "" when not
    recorded."""
    hosts_by_rank: list[str] = field(default_factory=list)
    """Each rank's host name ([] for measurements from before it was recorded)."""
    injected_faults: dict[str, str] = field(default_factory=dict)
    """Faults injected on purpose in any round (:mod:`dspark.bench.faults`); such a result is shown
    as injected in every table and never enters noise history or regression baselines."""
    # inside a step (``dspark bench --profile``; see dspark.bench.analyse.breakdown)
    profiled: bool = False
    """Whether the run asked for the step breakdown (``--profile``)."""
    phase_ms_by_rank: list[dict[str, float]] = field(default_factory=list)
    """Per rank, the median of each ``engine.step_stats()`` key (``forward_ms``, ``compute_ms``,
    ...) over every timed step of every round; [] when not profiled, and for a PyTorch peer,
    which has no step breakdown."""
    compute_ms_range_by_rank: list[list[float]] = field(default_factory=list)
    """Per rank, ``[p10, p90]`` of ``compute_ms`` over the same steps (the straggler rule's
    noise)."""
    audit_by_rank: list[dict[str, Any]] = field(default_factory=list)
    """Per rank, after the batch probe: ``{"rows_checked": n, "above_share": [rows]}``, the rows of
    ``engine.audit()`` held above their share; [] for a PyTorch peer or an older measurement."""
    # scaling, computed when read (see dspark.bench.analyse.analysis)
    speedup: float | None = None
    """Median over rounds of (baseline round median / this round median)."""
    speedup_min: float | None = None
    speedup_max: float | None = None
    round_speedups: list[float] = field(default_factory=list)
    efficiency: float | None = None
    baseline_result_id: str | None = None
    """The 1-device result of the same run the speedup is against (None: no speedup)."""
    predicted_peak_bytes_per_rank: int | None = None
    """The plan's peak per rank for this configuration, from its 1-device baseline (see
    :mod:`dspark.bench.analyse.off_plan`); None without a baseline."""
    predicted_step_ms: float | None = None
    """The plan's step for this configuration, from the same baseline."""
    anomalies: list[dict[str, Any]] = field(default_factory=list)
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

    @property
    def config(self) -> BenchConfig:
        """The configuration that produced this result (step counts included)."""
        steps = ({"warmup_steps": self.warmup_steps, "measure_steps": self.measure_steps}
                 if self.measure_steps > 0 else {})
        return BenchConfig(workload=self.workload, num_devices=self.num_devices,
                           strategy=self.strategy, precision=self.precision,
                           batch_placement=self.batch_placement, global_batch=self.global_batch,
                           max_micro_batch=self.max_micro_batch, **steps)


def _key(item: BenchConfig | BenchResult) -> ConfigKey:
    return (item.workload, item.num_devices, item.strategy, item.precision,
            item.batch_placement, item.global_batch)


def _baseline_key(item: BenchConfig | BenchResult) -> ConfigKey:
    return (item.workload, 1, item.strategy, item.precision, "shard", item.global_batch)
