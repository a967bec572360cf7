"""One benchmark configuration, measured: the program every rank runs.

``python -m dspark.bench.worker --config JSON --out PATH`` is started by the runner through the
launcher (one process per rank). Each rank builds the same model from the same seed, makes the
same global batch each step and keeps its slice of it (or all of it: ``batch_placement ==
"replicate"`` is the seed's bug, chosen on purpose). Warm-up steps are discarded; each timed step
starts after a barrier, and its time is the slowest rank's. Rank 0 writes one
:class:`~dspark.bench.result.BenchResult` as JSON to ``PATH``.

[Note: what a step's time covers] forward, loss, backward and the optimizer step, with their
collectives. Making the synthetic batch and slicing it stand for a data loader and are outside the
timed region, as they are outside the peak memory region.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dspark
from dspark import comm
from dspark.bench.memory import measure_peak_bytes
from dspark.bench.peers import make_engine
from dspark.bench.provenance import collect_provenance
from dspark.bench.result import BenchConfig, BenchResult
from dspark.tensor.fingerprint import batch_fingerprint

__all__ = ["bus_bytes_per_s", "error_path", "main", "replicated_inputs", "run_config",
           "step_time_summary"]

_MODEL_SEED = 0
_LEARNING_RATE = 3e-4
_BUS_PROBE_BYTES = 16 * 2**20
"""Large enough that a ring all-reduce is bandwidth-bound, small enough to take milliseconds."""
_BUS_PROBE_REPEATS = 3
_STATE_PARTS = ("params", "grads", "optimizer")

Batch = tuple[torch.Tensor, ...]


def step_time_summary(step_ms: Sequence[float]) -> tuple[float, float, float]:
    """``(median, p10, p90)`` of step times, linearly interpolated between steps.

    Example::

        step_time_summary([10.0, 12.0, 11.0])   # (11.0, 10.2, 11.8)
    """
    if not step_ms:
        raise ValueError("step_ms=[] holds no timed step; measure_steps must be >= 1")
    median, p10, p90 = np.percentile(np.asarray(step_ms, dtype=np.float64), [50, 10, 90])
    return float(median), float(p10), float(p90)


def replicated_inputs(local_batch: Batch) -> list[str]:
    """Names (``"batch[i]"``) of the tensors of this rank's batch that every rank holds identically,
    compared by the batch fingerprints the engine's replicated-batch check uses (one all-gather of a
    few float64 values per tensor, no copy of the data). Collective: every rank calls it.

    Example::

        replicated_inputs(dspark.distribute_batch((x, y), shard_dim=dspark.REPLICATE))
        # ["batch[0]", "batch[1]"] on 2 ranks
    """
    if comm.get_world().world_size <= 1:
        return []
    device = local_batch[0].device
    mine = torch.stack([batch_fingerprint(t, device=device) for t in local_batch])  # (tensors, 6)
    everyone = comm.all_gather(mine)
    return [f"batch[{i}]" for i in range(len(local_batch))
            if mine[i, 1] > 0 and all(torch.equal(theirs[i], mine[i]) for theirs in everyone)]


def _own(tensor: torch.Tensor) -> torch.Tensor:
    # A slice is a view that keeps the whole global batch alive; a data loader would only have
    # read this rank's part, so the rank gets a copy of just that part.
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bus_bytes_per_s(device: torch.device, num_ranks: int) -> float:
    """Collective bandwidth measured now: wire bytes per second of a ~16 MB all-reduce, the
    slowest rank's; ``0.0`` with one rank. Every rank must call it.

    Example::

        bus_bytes_per_s(world.device, world.world_size)   # e.g. 1.9e9 on loopback gloo
    """
    if num_ranks <= 1:
        return 0.0
    payload = torch.ones(_BUS_PROBE_BYTES // 4, dtype=torch.float32, device=device)
    comm.all_reduce(payload)  # the first call also sets up connections: not timed
    comm.reset_stats()
    comm.barrier()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(_BUS_PROBE_REPEATS):
        comm.all_reduce(payload)
    _synchronize(device)
    elapsed_s = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    wire_bytes = comm.stats()["all_reduce"].wire_bytes
    comm.all_reduce(elapsed_s, op="max")
    comm.reset_stats()
    return wire_bytes / float(elapsed_s.item())


def _pin_to_core(local_rank: int, local_world_size: int) -> None:
    # One device is one core on CPU: without pinning, ranks and their gloo threads migrate.
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= local_world_size:
        os.sched_setaffinity(0, {cores[local_rank]})


class _Trainer:
    """The model, engine and data of one configuration on this rank."""

    def __init__(self, config: BenchConfig, world: dspark.World) -> None:
        from dspark.models import get_workload

        self.config = config
        self.world = world
        self.workload = get_workload(config.workload)
        model = self.workload.build_model(seed=_MODEL_SEED, device=world.device)
        self.engine: Any = make_engine(config.strategy, model, world, lr=_LEARNING_RATE,
                                       precision=config.precision,
                                       batch_check=config.batch_placement == "shard")
        self.shard_dim: Any = 0 if config.batch_placement == "shard" else dspark.REPLICATE
        self.local_batch = 0
        """Samples this rank got in the last batch."""

    def batch(self, step: int) -> Batch:
        """This rank's part of step ``step``'s global batch (the same on every rank)."""
        whole = self.workload.make_batch(self.config.global_batch, seed=step, device=self.world.device)
        held = tuple(_own(t) for t in dspark.distribute_batch(whole, shard_dim=self.shard_dim))
        self.local_batch = int(held[0].shape[0])
        return held

    def step(self, batch: Batch) -> None:
        """Forward, loss, backward, optimizer step."""
        if self.engine is None:
            raise AssertionError("_Trainer.step after close()")
        inputs, targets = batch
        self.engine.backward(self.workload.loss(self.engine(inputs), targets))
        self.engine.step()

    def memory_report(self) -> dict[str, int | str]:
        if self.engine is None:
            raise AssertionError("_Trainer.memory_report after close()")
        return self.engine.memory_report()

    def close(self) -> None:
        """Drop the engine and model: nothing may hold the process group at shutdown."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None


def _timed_steps(trainer: _Trainer, first_step: int, num_steps: int) -> list[float]:
    device = trainer.world.device
    step_ms = []
    for step in range(first_step, first_step + num_steps):
        batch = trainer.batch(step)
        comm.barrier()  # every rank starts the step together
        _synchronize(device)
        start = time.perf_counter()
        trainer.step(batch)
        _synchronize(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
    return step_ms


def run_config(config: BenchConfig) -> BenchResult:
    """Measure ``config`` on the current world (call after :func:`dspark.init`); every rank gets
    the same result.

    Example::

        dspark.init()
        result = run_config(BenchConfig(workload="gpt2-cpu", num_devices=2, global_batch=4))
    """
    world = dspark.get_world()
    if world.world_size != config.num_devices:
        raise ValueError(f"config.num_devices={config.num_devices} but the job has "
                         f"world_size={world.world_size} ranks; launch one rank per device")
    device = world.device
    trainer = _Trainer(config, world)
    try:
        bus_rate = bus_bytes_per_s(device, world.world_size)
        for step in range(config.warmup_steps):
            trainer.step(trainer.batch(step))
        comm.reset_stats()
        local_step_ms = _timed_steps(trainer, config.warmup_steps, config.measure_steps)
        traffic = comm.stats()  # read before the reductions below add their own bytes
        estimate = getattr(trainer.engine, "estimated_traffic_per_step", None)
        if estimate is not None:  # a PyTorch peer: its collectives bypass DSpark's counters
            payload, wire = estimate()
            traffic = {"estimated": comm.CollectiveStats(config.measure_steps,
                                                         payload * config.measure_steps,
                                                         wire * config.measure_steps)}
        memory = trainer.memory_report()
        peak_batch = trainer.batch(config.warmup_steps + config.measure_steps)
        replicated = replicated_inputs(peak_batch)  # a collective: outside the timed steps
        peak_bytes = measure_peak_bytes(lambda: trainer.step(peak_batch), device)
    finally:
        trainer.close()

    # Per step, the slowest rank's time; per rank figures, the largest.
    step_ms = torch.tensor(local_step_ms, dtype=torch.float64, device=device)
    comm.all_reduce(step_ms, op="max")
    per_rank = torch.tensor([peak_bytes, int(memory["total_bytes"]),
                             int(memory["total_bytes_expected"])], dtype=torch.int64, device=device)
    comm.all_reduce(per_rank, op="max")
    peak_max, state_max, state_expected_max = (int(v) for v in per_rank.tolist())
    parts = {part: [int(memory[f"{part}_bytes"]), int(memory[f"{part}_bytes_expected"])]
             for part in _STATE_PARTS}
    # the parts of the rank that holds the most model state (every rank asks; all get one answer)
    owner = torch.tensor([int(memory["total_bytes"]), world.rank], dtype=torch.int64, device=device)
    everyone = comm.all_gather(owner)
    heaviest = max(range(len(everyone)), key=lambda r: (int(everyone[r][0]), -r))
    parts = comm.broadcast_object(parts, src=heaviest)
    median_ms, p10_ms, p90_ms = step_time_summary(step_ms.tolist())
    provenance = collect_provenance(device=device, backend=world.backend)
    return BenchResult(
        **{k: v for k, v in asdict(config).items() if k in BenchResult.__dataclass_fields__},
        step_ms=median_ms, step_ms_p10=p10_ms, step_ms_p90=p90_ms,
        samples_per_s=config.global_batch / (median_ms / 1e3),
        peak_bytes_per_rank=peak_max,
        model_state_bytes_per_rank=state_max,
        model_state_bytes_expected_per_rank=state_expected_max, model_state_parts=parts,
        local_batch=trainer.local_batch, replicated_inputs=replicated,
        comm_bytes_per_step=sum(e.bytes for e in traffic.values()) // config.measure_steps,
        comm_wire_bytes_per_step=sum(e.wire_bytes for e in traffic.values()) // config.measure_steps,
        bus_bytes_per_s=bus_rate, config_hash=config.config_hash(),
        **asdict(provenance),
    )


def error_path(out: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its traceback when it fails (beside the result file).

    Example::

        error_path(Path("/tmp/x/result.json"), 1)   # Path("/tmp/x/result.json.rank1.error")
    """
    return out.with_name(f"{out.name}.rank{rank}.error")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.worker",
                                     description="Measure one benchmark configuration (one rank).")
    parser.add_argument("--config", required=True, help="BenchConfig fields as a JSON object")
    parser.add_argument("--out", required=True, type=Path, help="where rank 0 writes the result JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one rank: measure the configuration, rank 0 writes the result.

    Example::

        python -m dspark.bench.worker --config '{"workload": "gpt2-cpu", "num_devices": 1}' --out r.json
    """
    args = _parse(argv)
    config = BenchConfig(**json.loads(args.config))
    world = dspark.init()
    if world.device.type == "cpu":
        torch.set_num_threads(1)
        _pin_to_core(world.local_rank, world.local_world_size)
    try:
        result = run_config(config)
        if world.is_main:
            args.out.write_text(json.dumps(result.to_dict(), indent=2))
    except BaseException:
        # The launcher's own failure summary buries the traceback in stderr; the runner reads
        # this file instead to report what went wrong.
        error_path(args.out, world.rank).write_text(f"rank {world.rank}: {traceback.format_exc()}")
        raise
    finally:
        gc.collect()  # no model may hold the process group when it is destroyed
        dspark.shutdown()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
