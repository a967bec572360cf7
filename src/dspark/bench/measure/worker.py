"""One launch of one benchmark configuration (a *round*), measured: the program every rank runs.

``python -m dspark.bench.measure.worker --config JSON --out PATH --round R [--probe] [--profile]
[--trace DIR]`` is started by the runner through the launcher (one process per rank). Each rank
builds the same model from the same seed, makes the same global batch each step and keeps its
slice of it (or all of it: ``batch_placement == "replicate"`` is the seed's bug, chosen on
purpose). Rank 0 writes one :class:`~dspark.bench.ledger.measurement.Measurement` as JSON to ``PATH``.

A launch, in order:

1. pin every thread to the rank's core (before ``dspark.init()``, and again once the engine exists;
   see [Note: pinning every thread] in :mod:`dspark.bench.measure.cpu_load`); DDP's and FSDP2's ranks keep
   glibc's own malloc thresholds, as their users have them, unless ``DSPARK_CPU_MALLOC`` is set
   (DSpark's engine sets its own, see :mod:`dspark.cpu_malloc`; recorded as ``cpu_malloc``);
2. with ``--trace DIR``: the engine's own trace (``Engine(trace_dir=DIR)``) of
   :data:`TRACE_STEPS` untimed steps, first, so that the profiler is gone before anything is
   measured (DSpark's engine only: a peer, PyTorch's or DeepSpeed's, has no trace option);
3. with ``--probe`` (a configuration's first round): two untimed steps under the batch probe
   (what each rank's model received, see :mod:`dspark.bench.measure.batch_probe`), the second one reading
   the model state held between backward and optimizer step (:mod:`dspark.bench.measure.model_state`);
   then ``engine.audit()``, whose rows above their share are kept;
4. the remaining warm-up steps (traced and probe steps count as warm-up), at least one after a
   probe, so that the first timed step's ``data_ms`` (from the previous ``step()``) holds no audit;
5. the timed steps, with the garbage collector off and the load on each rank's core read over
   exactly this window; each step starts after a barrier; with ``--profile``,
   ``engine.step_stats()`` is read after each one, outside its time;
6. with ``--probe``: the peak resident memory of the timed steps (its high-water mark is reset
   when they start), then the tensor peak of one more step (:mod:`dspark.bench.measure.memory`), whose
   profiler would otherwise count in the resident peak.

[Note: what a step's time covers] forward, loss, backward and the optimizer step, with their
collectives. Making the synthetic batch and slicing it stand for a data loader and are outside the
timed region, as they are outside the peak memory region.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import dspark
from dspark import comm, cpu_malloc
from dspark.bench.ledger.measurement import Measurement
from dspark.bench.measure.batch_probe import BatchInspection, inspect_batches
from dspark.bench.measure.cpu_load import (
    RankLoad,
    core_for_rank,
    cpu_snapshot,
    pin_all_threads,
    thread_ids,
    window_load,
)
from dspark.bench.measure.memory import measure_peak_bytes, peak_rss_bytes, reset_peak_rss
from dspark.bench.measure.model_state import expected_model_state, held_model_state, param_specs
from dspark.bench.measure.peers import (
    PEERS,
    TORCH_PEERS,
    buffer_sync,
    dspark_engine_options,
    make_engine,
)
from dspark.bench.measure.provenance import collect_provenance
from dspark.bench.result import BenchConfig
from dspark.engine.for_the_lab import kernel_name

__all__ = ["PROBE_STEPS", "SLOW_RANK_ENV", "TRACE_STEPS", "bus_bytes_per_s", "error_path", "main",
           "out_of_memory_hint", "run_config"]

_log = logging.getLogger(__name__)

_MODEL_SEED = 0
_LEARNING_RATE = 3e-4
_BUS_PROBE_BYTES = 16 * 2**20
"""Large enough that a ring all-reduce is bandwidth-bound, small enough to take milliseconds."""
_BUS_PROBE_REPEATS = 3
PROBE_STEPS = 2
"""Untimed steps of the batch probe; they count as warm-up steps."""
TRACE_STEPS = (1, 2)
"""``Engine(trace_steps=...)`` under ``--trace``: one untraced step, then two traced (all untimed)."""
SLOW_RANK_ENV = "DSPARK_BENCH_SLOW_RANK"
"""``"RANK:MS"`` makes rank ``RANK`` sleep ``MS`` ms in each forward: a straggler made on purpose,
for the lab's own tests of the straggler rule. Never set in a real measurement."""

Batch = tuple[torch.Tensor, ...]


def _own(tensor: torch.Tensor) -> torch.Tensor:
    # A slice is a view that keeps the whole global batch alive; a data loader would only have
    # read this rank's part, so the rank gets a copy of just that part.
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bus_bytes_per_s(device: torch.device, num_ranks: int) -> float:
    """Collective bandwidth measured now: wire bytes per second of an all-reduce of ``_BUS_PROBE_BYTES``, the
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


class _Trainer:
    """The model, engine and data of one configuration on this rank."""

    def __init__(self, config: BenchConfig, world: dspark.World, *,
                 trace_dir: Path | None = None) -> None:
        from dspark.models import get_workload

        self.config = config
        self.world = world
        self.workload = get_workload(config.workload)
        if config.max_micro_batch is not None:  # dspark bench --micro-batch
            self.workload = dataclasses.replace(self.workload, max_micro_batch=config.max_micro_batch)
        model = self.workload.build_model(seed=_MODEL_SEED, device=world.device)
        _slow_down(model, world.rank)
        self.specs = param_specs(model)  # before the engine shards the parameters in place
        self.is_dspark = config.strategy not in PEERS
        # a rank's share of the step in passes the device holds (the workload's max_micro_batch)
        local = (config.global_batch if config.batch_placement == "replicate"
                 else -(-config.global_batch // world.world_size))
        self.passes = self.workload.passes(local)
        self.options = (dspark_engine_options(batch_placement=config.batch_placement)
                        if self.is_dspark else {})
        # Not recorded in engine_options: where a trace goes does not change what is measured.
        tracing = ({"trace_dir": trace_dir, "trace_steps": TRACE_STEPS}
                   if trace_dir is not None and self.is_dspark else {})
        self.engine: Any = make_engine(config.strategy, model, world, lr=_LEARNING_RATE,
                                       precision=config.precision,
                                       options={**self.options, **tracing},
                                       global_batch=config.global_batch,
                                       grad_accum_steps=self.passes)
        if not self.is_dspark:  # a peer records its configuration (DeepSpeed's, its accumulation)
            self.options = dict(self.engine.options)
        else:
            if self.passes > 1:
                self.options["grad_accum_steps"] = self.passes
            # the whole configuration it ran with, next to the result (where a trace goes aside)
            recorded = self.engine.config.to_dict()
            recorded.pop("observation")
            self.options["engine_config"] = recorded
        self.optimizer_kernel = kernel_name(self.engine.optimizer)
        self.traced = bool(tracing)
        self.shard_dim: Any = 0 if config.batch_placement == "shard" else dspark.REPLICATE

    def batch(self, step: int) -> Batch:
        """This rank's part of step ``step``'s global batch (the same on every rank)."""
        whole = self.workload.make_batch(self.config.global_batch, seed=step, device=self.world.device)
        return tuple(_own(t) for t in dspark.distribute_batch(whole, shard_dim=self.shard_dim))

    def _live(self) -> Any:
        if self.engine is None:
            raise AssertionError("_Trainer used after close()")
        return self.engine

    def forward_backward(self, batch: Batch) -> None:
        """Forward, loss and backward of this rank's share, in :attr:`passes` equal micro-batches
        (gradients accumulate; the engines average them over the window)."""
        inputs, targets = batch
        engine = self._live()
        if self.passes == 1:
            engine.backward(self.workload.loss(engine(inputs), targets))
            return
        for x, y in zip(inputs.chunk(self.passes), targets.chunk(self.passes), strict=True):
            engine.backward(self.workload.loss(engine(x), y))

    def optimizer_step(self) -> None:
        self._live().step()

    def step(self, batch: Batch) -> None:
        """Forward, loss, backward, optimizer step."""
        self.forward_backward(batch)
        self.optimizer_step()

    def step_stats(self) -> dict[str, float] | None:
        """``engine.step_stats()`` of the last step; None for a peer (it has none)."""
        return self._live().step_stats() if self.is_dspark else None

    def audit(self) -> dict[str, Any] | None:
        """What ``engine.audit()`` found above its share (a collective); None for a peer."""
        if not self.is_dspark:
            return None
        from dspark.engine import above_share

        rows = self._live().audit()
        return {"rows_checked": len(rows), "above_share": above_share(rows)}

    def held_state(self) -> dict[str, int]:
        engine = self._live()
        return held_model_state(engine.module, engine.optimizer)

    def expected_state(self) -> dict[str, int]:
        return expected_model_state(self.specs, PEERS.get(self.config.strategy, self.config.strategy),
                                    self._live().optimizer, rank=self.world.rank,
                                    num_ranks=self.world.world_size)

    def close(self) -> None:
        """Drop the engine and model: nothing may hold the process group at shutdown."""
        if self.engine is not None:
            self.engine.close()
        self.engine = None


def _slow_down(model: torch.nn.Module, rank: int) -> None:
    """Make this rank a straggler when :data:`SLOW_RANK_ENV` names it (the lab's own tests only)."""
    spec = os.environ.get(SLOW_RANK_ENV, "")
    if not spec:
        return
    try:
        slow_rank, sleep_ms = spec.split(":")
        target, seconds = int(slow_rank), float(sleep_ms) / 1e3
    except ValueError:
        raise ValueError(f"{SLOW_RANK_ENV}={spec!r} is not RANK:MS (e.g. 1:80)") from None
    if rank == target:
        _log.warning("rank %d sleeps %g ms in every forward (%s=%r): a straggler on purpose, "
                     "not a measurement", rank, seconds * 1e3, SLOW_RANK_ENV, spec)
        # A pre-hook on the root runs inside the engine's forward: it counts as this rank's compute.
        model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


def _probe(trainer: _Trainer, first_step: int) -> tuple[BatchInspection, dict[str, int],
                                                        dict[str, int]]:
    held: dict[str, int] = {}

    def second() -> None:
        trainer.forward_backward(trainer.batch(first_step + 1))
        held.update(trainer.held_state())  # gradients are held between backward and step
        trainer.optimizer_step()

    inspection = inspect_batches(trainer._live().module,
                                 [lambda: trainer.step(trainer.batch(first_step)), second],
                                 comm.all_gather_object, submodules=trainer.world.world_size > 1)
    return inspection, held, trainer.expected_state()


def _timed_steps(trainer: _Trainer, first_step: int, num_steps: int, *, core: int | None,
                 threads: tuple[int, int], phases: dict[str, list[float]] | None = None,
                 ) -> tuple[list[float], RankLoad]:
    """Time ``num_steps`` steps; with ``phases``, append each step's ``step_stats()`` to it."""
    device = trainer.world.device
    step_ms = []
    gc.collect()
    gc.disable()  # a collection inside a timed step would be charged to the step
    try:
        before = cpu_snapshot(core)
        for step in range(first_step, first_step + num_steps):
            batch = trainer.batch(step)
            comm.barrier()  # every rank starts the step together
            _synchronize(device)
            start = time.perf_counter()
            trainer.step(batch)
            _synchronize(device)
            step_ms.append((time.perf_counter() - start) * 1e3)
            stats = trainer.step_stats() if phases is not None else None
            if phases is not None and stats is not None:
                for key, ms in stats.items():
                    phases.setdefault(key, []).append(ms)
        after = cpu_snapshot(core)
    finally:
        gc.enable()
    return step_ms, window_load(before, after, rank=trainer.world.rank, core=core, threads=threads)


def run_config(config: BenchConfig, *, round_index: int = 0, probe: bool = True,
               core: int | None = None, profile: bool = False,
               trace_dir: Path | None = None) -> Measurement:
    """Measure one round of ``config`` on the current world (call after :func:`dspark.init`);
    every rank gets the same measurement. ``core`` is the core this rank is pinned to (its
    threads are pinned to it again once the engine exists); None leaves threads where they are.
    ``profile`` keeps ``engine.step_stats()`` of every timed step; ``trace_dir`` has the engine
    write ``trace_dir/rank{R}.json`` of :data:`TRACE_STEPS` untimed steps first.

    Example::

        dspark.init()
        m = run_config(BenchConfig(workload="gpt2-cpu", num_devices=2, global_batch=4))
    """
    world = dspark.get_world()
    if world.world_size != config.num_devices:
        raise ValueError(f"config.num_devices={config.num_devices} but the job has "
                         f"world_size={world.world_size} ranks; launch one rank per device")
    device = world.device
    trainer = _Trainer(config, world, trace_dir=trace_dir)
    threads = pin_all_threads(core) if core is not None else (len(thread_ids()), 0)
    mine: dict[str, Any] = {"held": {}, "expected": {}, "tensor_peak": 0, "rss_peak": 0,
                            "host": socket.gethostname(), "phases": None, "audit": None}
    inspection: BatchInspection | None = None
    rss_scope = ""
    try:
        step = 0
        # The trace first: its profiler must be gone before anything below is measured.
        for _ in range(sum(TRACE_STEPS) if trainer.traced else 0):
            trainer.step(trainer.batch(step))
            step += 1
        bus_rate = bus_bytes_per_s(device, world.world_size)
        if probe:
            inspection, mine["held"], mine["expected"] = _probe(trainer, step)
            mine["audit"] = trainer.audit()  # the probe's last batch is the engine's last input
            step += PROBE_STEPS
        # at least one untimed step after the probe: the first timed step's data_ms runs from the
        # previous step(), and the audit between them is no part of loading data
        for _ in range(max(1 if probe else 0, config.warmup_steps - step)):
            trainer.step(trainer.batch(step))
            step += 1
        if probe:
            rss_scope = "timed steps" if reset_peak_rss() else "process lifetime"
        comm.reset_stats()
        phases: dict[str, list[float]] | None = {} if profile else None
        mine["step_ms"], load = _timed_steps(trainer, step, config.measure_steps, core=core,
                                             threads=threads, phases=phases)
        mine["phases"] = phases
        traffic = comm.stats()  # read before the exchanges below add their own bytes
        mine["load"] = asdict(load)
        step += config.measure_steps
        if probe:
            mine["rss_peak"] = peak_rss_bytes()
            # after the RSS peak: the profiler's own buffers must not count in it
            peak_batch = trainer.batch(step)
            mine["tensor_peak"] = measure_peak_bytes(lambda: trainer.step(peak_batch), device)
        estimate = getattr(trainer.engine, "estimated_traffic_per_step", None)
        estimated = estimate() if estimate is not None else None
        options = dict(trainer.options)
        optimizer_kernel = trainer.optimizer_kernel
        passes = trainer.passes
        is_dspark = trainer.is_dspark
    finally:
        trainer.close()

    everyone = comm.all_gather_object(mine)
    # A peer's collectives bypass DSpark's counters: its traffic is estimated, never "measured".
    counted = estimated is None
    # DSpark's collectives may travel through shared memory (dspark.comm.transport()); a peer's
    # go through the process group as its users run it
    transport = comm.transport() if is_dspark else world.backend
    provenance = collect_provenance(
        device=device, backend=world.backend if transport == world.backend else f"{world.backend}+{transport}")
    return Measurement(
        **asdict(config), round_index=round_index,
        step_ms_by_rank=[e["step_ms"] for e in everyone],
        rank_loads=[e["load"] for e in everyone],
        tensor_peak_bytes_by_rank=[e["tensor_peak"] for e in everyone] if probe else [],
        rss_peak_bytes_by_rank=[e["rss_peak"] for e in everyone] if probe else [],
        rss_scope=rss_scope,
        state_held_by_rank=[e["held"] for e in everyone] if probe else [],
        state_expected_by_rank=[e["expected"] for e in everyone] if probe else [],
        batch=asdict(inspection) if inspection is not None else None,
        comm_bytes_per_step=(sum(e.bytes for e in traffic.values()) // config.measure_steps
                             if counted else None),
        comm_wire_bytes_per_step=(sum(e.wire_bytes for e in traffic.values()) // config.measure_steps
                                  if counted else None),
        estimated_comm_bytes_per_step=estimated[0] if estimated else None,
        estimated_comm_wire_bytes_per_step=estimated[1] if estimated else None,
        bus_bytes_per_s=bus_rate, buffer_sync=buffer_sync(config.strategy),
        engine_options=options, optimizer_kernel=optimizer_kernel, micro_batches=passes,
        cpu_malloc=malloc.describe() if (malloc := cpu_malloc.current()) is not None else "",
        hosts_by_rank=[e["host"] for e in everyone], profiled=profile,
        phase_ms_by_rank=([e["phases"] for e in everyone]
                          if profile and all(e["phases"] for e in everyone) else []),
        audit_by_rank=([e["audit"] for e in everyone]
                       if all(e["audit"] is not None for e in everyone) else []),
        config_hash=config.config_hash(), **asdict(provenance))


def out_of_memory_hint(exc: BaseException, config: BenchConfig) -> str:
    """The fix for a step that did not fit the GPU, as a line to follow its traceback ("" for
    any other failure).

    Example::

        out_of_memory_hint(torch.cuda.OutOfMemoryError("..."), config)
        # "\nThe step did not fit the GPU: --micro-batch N runs each rank's share ..."
    """
    if not isinstance(exc, torch.cuda.OutOfMemoryError):
        return ""
    from dspark.models import get_workload

    limit = config.max_micro_batch or get_workload(config.workload).max_micro_batch
    now = f"at most {limit} samples a pass now" if limit else "its share in one pass now"
    return (f"\nThe step did not fit the GPU ({config.workload}, global batch "
            f"{config.global_batch} on {config.num_devices} device(s), {now}): `dspark bench "
            "--micro-batch N` runs each rank's share in passes of at most N samples, gradients "
            "accumulated into one step; or lower --global-batch\n")


def error_path(out: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its traceback when it fails (beside the result file).

    Example::

        error_path(Path("/tmp/x/result.json"), 1)   # Path("/tmp/x/result.json.rank1.error")
    """
    return out.with_name(f"{out.name}.rank{rank}.error")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.measure.worker",
                                     description="Measure one round of one benchmark configuration "
                                                 "(one rank).")
    parser.add_argument("--config", required=True, help="BenchConfig fields as a JSON object")
    parser.add_argument("--out", required=True, type=Path,
                        help="where rank 0 writes the measurement JSON")
    parser.add_argument("--round", type=int, default=0, help="the round's index in its run")
    parser.add_argument("--probe", action="store_true",
                        help="also probe the batch and measure memory (a configuration's first round)")
    parser.add_argument("--profile", action="store_true",
                        help="keep engine.step_stats() of every timed step")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="the engine writes DIR/rank{R}.json, a profiler trace of untimed steps")
    return parser.parse_args(argv)


def _core_from_launcher_env() -> int | None:
    # Read before dspark.init(), which is what starts gloo's threads: see cpu_load.
    if torch.cuda.is_available():
        return None  # the devices are GPUs; CPU threads are left to the OS
    return core_for_rank(int(os.environ.get("LOCAL_RANK", "0")),
                         int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one rank: measure the configuration, rank 0 writes the measurement.

    Example::

        python -m dspark.bench.measure.worker --config '{"workload": "gpt2-cpu", "num_devices": 1}' --out r.json
    """
    args = _parse(argv)
    config = BenchConfig(**json.loads(args.config))
    if config.strategy in TORCH_PEERS:
        # DDP and FSDP2 run as their users run them, on glibc's own malloc thresholds, unless the
        # caller chose (DSPARK_CPU_MALLOC=tuned gives them DSpark's too): see dspark.cpu_malloc. The
        # DeepSpeed peers get DSpark's, as they get its optimizer kernel: their ratio compares engines.
        os.environ.setdefault(cpu_malloc.ENV_VAR, "default")
    if not torch.cuda.is_available():
        cpu_malloc.tune_for_training()  # what DSpark's engine would do first, for every strategy
    core = _core_from_launcher_env()
    if core is not None:
        pin_all_threads(core)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # one device is one core
    world = dspark.init()
    try:
        measurement = run_config(config, round_index=args.round, probe=args.probe, core=core,
                                 profile=args.profile, trace_dir=args.trace)
        if world.is_main:
            args.out.write_text(json.dumps(measurement.to_dict(), indent=2))
    except BaseException as exc:
        # The launcher's own failure summary buries the traceback in stderr; the runner reads
        # this file instead to report what went wrong (its end: the hint goes last).
        error_path(args.out, world.rank).write_text(
            f"rank {world.rank}: {traceback.format_exc()}{out_of_memory_hint(exc, config)}")
        raise
    finally:
        gc.collect()  # no model may hold the process group when it is destroyed
        dspark.shutdown()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
