"""The raw figures of one launch of one configuration (a *round*), as the ledger keeps them, and how
the rounds of a run are summarised into a :class:`~dspark.bench.result.BenchResult` when read.

[Note: rounds] On a shared CPU box the speed of a core drifts by more than the effects the lab
measures. So a run launches each configuration several times, taking turns with its 1-device baseline
(round 0: 1 then N; round 1: N then 1; with several configurations on one baseline the order rotates,
see [Note: interleaved rounds] in :mod:`dspark.bench.measure.rounds`), and the speedup is the
median of the per-round ratios: a slow spell hits both sides of a ratio, not one side of a suite.
The memory and the batch probe are measured in a configuration's first round only (they do not
change between rounds and cost untimed steps).

Nothing derived is stored: a measurement keeps every timed step of every rank, the load of each
rank's core over its timed window, and the byte counts; step medians, speedups and anomalies are
computed from them when read.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark.bench.analyse.breakdown import step_breakdown
from dspark.bench.analyse.samples import counted_samples
from dspark.bench.measure.cpu_load import RankLoad
from dspark.bench.result import BenchConfig, BenchResult, ConfigKey, Recorded

__all__ = ["Measurement", "result_id_of", "results_from_measurements", "step_time_summary"]

_STATE_PARTS = ("params", "grads", "optimizer")


def step_time_summary(step_ms: Sequence[float]) -> tuple[float, float, float]:
    """``(median, p10, p90)`` of step times, linearly interpolated between steps.

    Example::

        step_time_summary([10.0, 12.0, 11.0])   # (11.0, 10.2, 11.8)
    """
    if not step_ms:
        raise ValueError("step_ms=[] holds no timed step; measure_steps must be >= 1")
    median, p10, p90 = np.percentile(np.asarray(step_ms, dtype=np.float64), [50, 10, 90])
    return float(median), float(p10), float(p90)


def result_id_of(run_id: str, config_hash: str) -> str:
    """The id of one configuration's result in one run.

    Example::

        result_id_of("20261130T052013Z-3fa9c1", "9f2c...")   # "20261130T052013Z-3fa9c1/9f2c..."
    """
    return f"{run_id}/{config_hash}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement(Recorded):
    """One launch of one configuration: what every rank measured (see [Note: rounds])."""

    # what ran
    workload: str
    num_devices: int
    strategy: str
    precision: str
    batch_placement: str
    global_batch: int
    warmup_steps: int
    measure_steps: int
    max_micro_batch: int | None = None
    """``dspark bench --micro-batch``; None: the workload's own limit."""
    run_id: str = ""
    round_index: int = 0
    rounds_planned: int = 0
    """Rounds the run planned for this configuration (0 in a row written before it was recorded):
    a round at or beyond it was not measured by that run (see [Note: hash chain])."""
    injected_faults: dict[str, str] = field(default_factory=dict)
    """Faults injected on purpose for the lab's own tests (:mod:`dspark.bench.faults`), by the
    variable that injected them; {} in a real measurement."""
    # time
    step_ms_by_rank: list[list[float]] = field(default_factory=list)
    """Every timed step of every rank (each step starts after a barrier)."""
    step_ms_summary: list[float] = field(default_factory=list)
    """``[median, p10, p90]`` for rows migrated from schema 1, which kept no samples; else []."""
    rank_loads: list[dict[str, Any]] = field(default_factory=list)
    """Per rank, :class:`~dspark.bench.measure.cpu_load.RankLoad` of its timed window, as a dict."""
    # memory and batch: the configuration's first round only
    tensor_peak_bytes_by_rank: list[int] = field(default_factory=list)
    rss_peak_bytes_by_rank: list[int] = field(default_factory=list)
    rss_scope: str = ""
    """What the RSS peak spans: ``"timed steps"`` (``"training steps"`` in older results) or
    ``"process lifetime"``."""
    state_held_by_rank: list[dict[str, int]] = field(default_factory=list)
    """Per rank: bytes held for params, grads, optimizer, buffers (between backward and step)."""
    state_expected_by_rank: list[dict[str, int]] = field(default_factory=list)
    batch: dict[str, Any] | None = None
    """The batch probe's :class:`~dspark.bench.measure.batch_probe.BatchInspection`, as a dict."""
    # traffic
    comm_bytes_per_step: int | None = None
    comm_wire_bytes_per_step: int | None = None
    estimated_comm_bytes_per_step: int | None = None
    estimated_comm_wire_bytes_per_step: int | None = None
    bus_bytes_per_s: float = 0.0
    buffer_sync: str = ""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """DSpark's engine: keyword arguments beyond the configuration, and ``engine_config``, the
    whole :class:`dspark.EngineConfig` it ran with (``to_dict()``, less where its trace went); a
    DeepSpeed peer: its ``deepspeed_config`` and ``deepspeed_version``."""
    optimizer_kernel: str = ""
    """The kernel the optimizer stepped with (``fused``, ``foreach``, ``for-loop``); "" in a row
    written before it was recorded."""
    micro_batches: int = 1
    """Forward/backward passes a rank ran per step (its share in micro-batches of at most the
    workload's ``max_micro_batch``; 1 in a row written before it was recorded)."""
    cpu_malloc: str = ""
    """How the workers' C library malloc was set (:mod:`dspark.cpu_malloc`): ``dspark`` or
    ``default (<why>)``; "" on a GPU device or in a row written before it was recorded."""
    hosts_by_rank: list[str] = field(default_factory=list)
    """Each rank's host name."""
    # inside a step
    profiled: bool = False
    """Whether the run asked for the step breakdown (``dspark bench --profile``)."""
    phase_ms_by_rank: list[dict[str, list[float]]] = field(default_factory=list)
    """With ``profiled``: per rank, ``engine.step_stats()`` after every timed step, key by key
    (``{"forward_ms": [...], ...}``); [] for a PyTorch peer, which has no step breakdown."""
    audit_by_rank: list[dict[str, Any]] = field(default_factory=list)
    """The configuration's first round, DSpark's engine only: per rank, after the batch probe,
    ``{"rows_checked": n, "above_share": [...]}``: the rows of ``engine.audit()`` above their share."""

    @property
    def config(self) -> BenchConfig:
        return BenchConfig(workload=self.workload, num_devices=self.num_devices,
                           strategy=self.strategy, precision=self.precision,
                           batch_placement=self.batch_placement, global_batch=self.global_batch,
                           warmup_steps=self.warmup_steps, measure_steps=self.measure_steps,
                           max_micro_batch=self.max_micro_batch)

    @property
    def key(self) -> ConfigKey:
        # Not through `config`: a schema-1 row may predate step counts (0), which BenchConfig refuses.
        return (self.workload, self.num_devices, self.strategy, self.precision,
                self.batch_placement, self.global_batch)

    @property
    def result_id(self) -> str:
        return result_id_of(self.run_id, self.config_hash)

    @property
    def measurement_id(self) -> str:
        """Unique in a ledger: one configuration's round ``round_index`` in one run."""
        return f"{self.result_id}/r{self.round_index}"

    def step_ms(self) -> list[float]:
        """Each timed step's time: the slowest rank's."""
        if not self.step_ms_by_rank:
            return []
        return [max(per_rank) for per_rank in zip(*self.step_ms_by_rank, strict=True)]

    def loads(self) -> list[RankLoad]:
        return [RankLoad(**load) for load in self.rank_loads]

    @classmethod
    def from_schema1(cls, row: dict[str, Any]) -> Measurement:
        """A result written by schema 1 (one summarised row per configuration, with the speedup and
        anomalies of its day frozen in): kept as a single round with its median, p10 and p90 and
        no samples; its frozen analysis is dropped and recomputed when read."""
        num_devices = int(row["num_devices"])
        parts = row.get("model_state_parts") or {}
        held = {part: int(parts[part][0]) for part in _STATE_PARTS if part in parts}
        expected = {part: int(parts[part][1]) for part in _STATE_PARTS if part in parts}
        if not held:
            held = {"params": int(row.get("model_state_bytes_per_rank", 0))}
            expected = {"params": int(row.get("model_state_bytes_expected_per_rank", 0))}
        local = int(row.get("local_batch", 0))
        return cls(
            **{k: row[k] for k in ("workload", "strategy", "precision", "batch_placement",
                                   "global_batch", "run_id")},
            num_devices=num_devices, warmup_steps=int(row.get("warmup_steps", 0)),
            measure_steps=int(row.get("measure_steps", 0)),
            step_ms_summary=[float(row["step_ms"]), float(row["step_ms_p10"]),
                             float(row["step_ms_p90"])],
            tensor_peak_bytes_by_rank=[int(row.get("peak_bytes_per_rank", 0))],
            state_held_by_rank=[held], state_expected_by_rank=[expected],
            batch=({"samples_by_rank": [local] * num_devices, "identical_input_ranks": [],
                    "replicated_modules": [], "replicated_module_count": 0} if local else None),
            comm_bytes_per_step=row.get("comm_bytes_per_step"),
            comm_wire_bytes_per_step=row.get("comm_wire_bytes_per_step"),
            bus_bytes_per_s=float(row.get("bus_bytes_per_s", 0.0)),
            **{k: row.get(k, "") for k in ("git_commit", "dspark_version", "torch_version",
                                           "python_version", "host", "device_model", "backend",
                                           "config_hash", "timestamp")},
            git_dirty=bool(row.get("git_dirty", False)))


def _round_median(m: Measurement) -> float:
    samples = m.step_ms()
    return statistics.median(samples) if samples else m.step_ms_summary[0]


def _machine_foreign_cores(loads: list[RankLoad]) -> float | None:
    # Rank 0's view of all cores, minus every rank's own work (see cpu_load).
    if not loads or loads[0].machine_busy_s is None or loads[0].window_s <= 0:
        return None
    own = sum(load.own_cpu_s for load in loads)
    return max(0.0, loads[0].machine_busy_s - own) / loads[0].window_s


def _foreign_share_by_rank(loads: list[list[RankLoad]]) -> list[float | None]:
    ranks = sorted({load.rank for per_round in loads for load in per_round})
    shares = [[s for per_round in loads for load in per_round
               if load.rank == rank and (s := load.foreign_share) is not None] for rank in ranks]
    return [max(found) if found else None for found in shares]


def _memory(first: Measurement | None) -> dict[str, Any]:
    if first is None or not first.state_held_by_rank:
        return {"model_state_bytes_per_rank": 0, "model_state_bytes_expected_per_rank": 0,
                "model_state_parts": {}, "buffer_bytes_per_rank": 0}
    totals = [sum(held.get(part, 0) for part in _STATE_PARTS) for held in first.state_held_by_rank]
    heaviest = max(range(len(totals)), key=lambda r: (totals[r], -r))
    held = first.state_held_by_rank[heaviest]
    expected = (first.state_expected_by_rank[heaviest]
                if heaviest < len(first.state_expected_by_rank) else {})
    return {"model_state_bytes_per_rank": totals[heaviest],
            "model_state_bytes_expected_per_rank": sum(expected.get(p, 0) for p in _STATE_PARTS),
            "model_state_parts": {p: [held.get(p, 0), expected.get(p, 0)] for p in _STATE_PARTS
                                  if p in held or p in expected},
            "buffer_bytes_per_rank": max(h.get("buffers", 0) for h in first.state_held_by_rank)}


def _summarise(rounds: list[Measurement]) -> BenchResult:
    rounds = sorted(rounds, key=lambda m: m.round_index)
    first = rounds[0]
    by_round = [m.step_ms() for m in rounds]
    pooled = [ms for samples in by_round for ms in samples]
    if not pooled and len(first.step_ms_summary) != 3:
        raise ValueError(f"measurement {first.measurement_id} holds no timed step and no summary")
    median, p10, p90 = step_time_summary(pooled) if pooled else tuple(first.step_ms_summary)
    probed = next((m for m in rounds if m.state_held_by_rank or m.batch is not None), None)
    batch = (probed.batch if probed is not None else None) or {}
    samples = [int(n) for n in batch.get("samples_by_rank", [])]
    loads = [m.loads() for m in rounds]
    shares = [[s for load in per_round if (s := load.foreign_share) is not None]
              for per_round in loads]
    pinned = [load for per_round in loads for load in per_round if load.core is not None]
    return BenchResult(
        **{k: getattr(first, k) for k in ("workload", "num_devices", "strategy", "precision",
                                          "batch_placement", "global_batch", "run_id",
                                          "warmup_steps", "measure_steps", "git_commit",
                                          "git_dirty", "dspark_version", "torch_version",
                                          "python_version", "host", "device_model", "backend",
                                          "config_hash", "timestamp", "buffer_sync",
                                          "max_micro_batch")},
        result_id=first.result_id, rounds=len(rounds),
        round_indices=[m.round_index for m in rounds],
        step_ms_by_round=[list(s) for s in by_round if s],
        round_step_ms=[_round_median(m) for m in rounds],
        step_ms=median, step_ms_p10=p10, step_ms_p90=p90,
        samples_per_step=counted_samples(samples, first.global_batch),
        samples_per_s=((counted_samples(samples, first.global_batch) or first.global_batch)
                       / (median / 1e3) if median > 0 else 0.0),
        peak_bytes_per_rank=max(probed.tensor_peak_bytes_by_rank, default=0) if probed else 0,
        peak_rss_bytes_per_rank=max(probed.rss_peak_bytes_by_rank, default=0) if probed else 0,
        rss_scope=probed.rss_scope if probed else "",
        **_memory(probed),
        local_batch=max(samples, default=0), batch_inspected=bool(batch),
        samples_by_rank=samples,
        identical_input_ranks=[list(p) for p in batch.get("identical_input_ranks", [])],
        replicated_modules=list(batch.get("replicated_modules", [])),
        replicated_module_count=int(batch.get("replicated_module_count", 0)),
        core_foreign_share_by_round=[max(s) if s else None for s in shares],
        machine_foreign_cores_by_round=[_machine_foreign_cores(per_round) for per_round in loads],
        core_foreign_share_by_rank=_foreign_share_by_rank(loads),
        threads_unpinned=max((load.threads - load.threads_pinned for load in pinned), default=0),
        ranks_pinned=bool(pinned) and len(pinned) == sum(len(per_round) for per_round in loads),
        comm_bytes_per_step=first.comm_bytes_per_step,
        comm_wire_bytes_per_step=first.comm_wire_bytes_per_step,
        estimated_comm_bytes_per_step=first.estimated_comm_bytes_per_step,
        estimated_comm_wire_bytes_per_step=first.estimated_comm_wire_bytes_per_step,
        bus_bytes_per_s=statistics.median(m.bus_bytes_per_s for m in rounds),
        engine_options=dict(first.engine_options), optimizer_kernel=first.optimizer_kernel,
        micro_batches=first.micro_batches,
        cpu_malloc=first.cpu_malloc,
        hosts_by_rank=list(first.hosts_by_rank),
        injected_faults={k: v for m in rounds for k, v in m.injected_faults.items()},
        audit_by_rank=list(probed.audit_by_rank) if probed else [],
        **step_breakdown(rounds))


def results_from_measurements(measurements: Sequence[Measurement]) -> list[BenchResult]:
    """One :class:`BenchResult` per configuration per run, in the order each first appears.

    Example::

        results_from_measurements(ledger.measurements(run_id="20261130T052013Z-3fa9c1"))
    """
    groups: dict[str, list[Measurement]] = {}
    for m in measurements:
        groups.setdefault(m.result_id, []).append(m)
    return [_summarise(rounds) for rounds in groups.values()]
