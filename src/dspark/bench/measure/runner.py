"""Running a suite: rounds of fresh worker launches, each measurement appended to the ledger the
moment it is measured, then the analysis of what the run recorded.

Every launch gets its own job through :mod:`dspark.launch.launcher` (PyTorch's launcher underneath; a
1-device launch is its one worker process alone, ``agent=False``): one process per device, so no
state (allocator caches, process groups, warm kernels) leaks from one measurement into the next. The
launches of a configuration alternate with its 1-device baseline's (see [Note: rounds] in
:mod:`dspark.bench.ledger.measurement`), so a slow spell of the machine hits both sides of a
speedup. A configuration that fails is reported with the tail of its stderr and not launched again;
what its earlier rounds measured stays recorded, as does everything else: a suite that dies half-way
keeps every finished measurement in the ledger.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import os
import secrets
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from dspark.bench.analyse.analysis import annotate
from dspark.bench.faults import injected_faults
from dspark.bench.ledger.ledger import Ledger
from dspark.bench.ledger.measurement import Measurement
from dspark.bench.measure.rounds import round_order
from dspark.bench.measure.worker import error_path
from dspark.bench.result import BenchConfig, BenchResult, ConfigKey
from dspark.errors import DSparkError
from dspark.launch.launcher import LaunchSpec, launch
from dspark.profiler_banner import is_banner

__all__ = ["DEFAULT_ROUNDS", "BenchRunError", "RunFailure", "describe_config", "interleaved_plan",
           "new_run_id", "run_in_workers", "run_suite", "trace_dir_of"]

_log = logging.getLogger(__name__)

_WORKER_MODULE = "dspark.bench.measure.worker"
_STDERR_TAIL_LINES = 25

DEFAULT_ROUNDS = 3
"""Launches per configuration in a run, alternating with its baseline's (at least 3, so the median
of the per-round speedups is not one ratio)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFailure:
    """A round of a configuration whose workers failed: nothing was recorded for that round."""

    config: BenchConfig
    exit_code: int
    """The launcher's exit code."""
    stderr_tail: str
    """The end of the first failing rank's traceback, else of the workers' stderr."""


class BenchRunError(DSparkError, RuntimeError):
    """Some configurations of a suite failed (the others were measured and recorded)."""

    def __init__(self, failures: Sequence[RunFailure]) -> None:
        self.failures = list(failures)
        names = "; ".join(describe_config(f.config) for f in self.failures)
        super().__init__(f"{len(self.failures)} configuration(s) failed: {names}")


def describe_config(config: BenchConfig) -> str:
    """A short human label for a configuration.

    Example::

        describe_config(BenchConfig(workload="gpt2-cpu", num_devices=2))
        # "gpt2-cpu, 2 devices, replicate, bf16, batch 32 shard"
    """
    devices = f"{config.num_devices} device" + ("" if config.num_devices == 1 else "s")
    return (f"{config.workload}, {devices}, {config.strategy}, {config.precision}, "
            f"batch {config.global_batch} {config.batch_placement}")


def new_run_id() -> str:
    """A fresh id for one ``dspark bench`` invocation: UTC time, then random hex.

    Example::

        new_run_id()   # "20261130T052013Z-3fa9c1"
    """
    now = _dt.datetime.now(_dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def _tail(text: str, lines: int = _STDERR_TAIL_LINES) -> str:
    kept = [line for line in text.splitlines() if not is_banner(line)]  # they bury a real error
    return "\n".join(kept[-lines:])


def interleaved_plan(configs: Sequence[BenchConfig], rounds: int) -> list[tuple[int, BenchConfig]]:
    """``(round, configuration)`` in launch order: per round, each 1-device baseline's group (the
    baseline and the configurations measured against it) in :func:`round_order`, so that the
    baseline is first in round 0 and takes every place over the rounds (see [Note: interleaved
    rounds] in :mod:`dspark.bench.measure.rounds`).

    Example::

        interleaved_plan([one, two], 3)   # [(0, one), (0, two), (1, two), (1, one), (2, one), (2, two)]
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    groups: dict[ConfigKey, list[BenchConfig]] = {}
    for config in dict.fromkeys(configs):  # each configuration once, in suite order
        group = groups.setdefault(config.baseline_key, [])
        if config.key == config.baseline_key:
            group.insert(0, config)
        else:
            group.append(config)
    plan = []
    for index in range(rounds):
        for group in groups.values():
            plan += [(index, config) for config in round_order(group, index)]
    return plan


def run_in_workers(config: BenchConfig, *, round_index: int = 0, probe: bool = True,
                   profile: bool = False, trace_dir: Path | None = None) -> Measurement | RunFailure:
    """Measure one round of a configuration in ``config.num_devices`` fresh worker processes;
    ``probe`` adds the batch probe, the audit and the memory measurement (a configuration's first
    round), ``profile`` the step breakdown of every timed step, and ``trace_dir`` a profiler trace
    per rank (``trace_dir/rank{R}.json``, of untimed steps; DSpark's engine only).

    Example::

        outcome = run_in_workers(BenchConfig(workload="gpt2-cpu", num_devices=2, global_batch=4))
        isinstance(outcome, Measurement)   # False when the workers failed: a RunFailure
    """
    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp:
        out = Path(tmp) / "measurement.json"
        args = ("--config", json.dumps(asdict(config)), "--out", str(out),
                "--round", str(round_index), *(("--probe",) if probe else ()),
                *(("--profile",) if profile else ()),
                *(("--trace", str(trace_dir)) if trace_dir is not None else ()))
        # One device: the worker alone, in a real one-rank process group, without torchrun's agent
        # (its start-up is a part of every baseline launch and measures nothing).
        spec = LaunchSpec(target=_WORKER_MODULE, module=True, nproc=config.num_devices, args=args,
                          agent=config.num_devices > 1)
        done = launch(spec, capture=True)
        if done.returncode == 0 and out.is_file():
            return Measurement.from_dict(json.loads(out.read_text()))
        # The first rank to fail holds the cause; the others often fail on its absence.
        errors = sorted((path for rank in range(config.num_devices)
                         if (path := error_path(out, rank)).is_file()),
                        key=lambda path: path.stat().st_mtime_ns)
        tail = (_tail(errors[0].read_text()) if errors else
                _tail(done.stderr or "") or _tail(done.stdout or "") or "(no output)")
        if done.returncode == 0:
            tail = f"the workers exited with 0 but wrote no result to {out}\n{tail}"
        return RunFailure(config=config, exit_code=done.returncode, stderr_tail=tail)


def _progress_bar(enabled: bool, console: Console | None) -> Progress:
    # A slow refresh: the bar shares the cores with the workers it is timing.
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TextColumn("{task.fields[left]}"), TimeElapsedColumn(),
                    console=console, refresh_per_second=2, disable=not enabled)


@contextmanager
def _open_ledger(db: Ledger | str | Path) -> Iterator[Ledger]:
    if isinstance(db, Ledger):
        yield db
        return
    with Ledger(db) as ledger:
        yield ledger


def trace_dir_of(config: BenchConfig, trace_root: str | Path) -> Path:
    """Where ``dspark bench --trace DIR`` puts a configuration's traces: ``DIR/<config slug>/``,
    one ``rank{R}.json`` per rank.

    Example::

        trace_dir_of(config, "traces")   # Path("traces/gpt2-cpu-2dev-replicate-bf16-shard32")
    """
    return Path(trace_root) / config.slug


def run_suite(configs: Sequence[BenchConfig], *, db: Ledger | str | Path,
              rounds: int = DEFAULT_ROUNDS, progress: bool = True, run_id: str | None = None,
              console: Console | None = None, failures: list[RunFailure] | None = None,
              profile: bool = False, trace_root: str | Path | None = None) -> list[BenchResult]:
    """Measure each configuration ``rounds`` times in fresh workers, interleaved with its baseline
    (:func:`interleaved_plan`), append every measurement to the ledger ``db`` as soon as it is
    taken, and return this run's results, annotated against the ledger's history.

    ``profile`` records the step breakdown of every timed step (``dspark bench --profile``);
    ``trace_root`` has each configuration's first round write a profiler trace per rank to
    :func:`trace_dir_of` (``dspark bench --trace DIR``).

    A configuration that fails is logged with its stderr tail and not launched again. Pass a
    ``failures`` list to receive them; without one, :class:`BenchRunError` is raised after the
    rest was recorded, so a failure is never silent.

    Example::

        failed: list[RunFailure] = []
        results = run_suite(build_suite("quick"), db=default_db_path(), failures=failed)
    """
    if not configs:
        raise ValueError("configs=[] is empty: there is nothing to run")
    plan = interleaved_plan(configs, rounds)
    run_id = run_id or new_run_id()
    failed: dict[BenchConfig, RunFailure] = {}
    probed: set[BenchConfig] = set()
    with _open_ledger(db) as ledger, _progress_bar(progress, console) as bar:
        task = bar.add_task("starting", total=len(plan), left="")
        try:
            for index, (round_index, config) in enumerate(plan):
                label = f"{describe_config(config)}, round {round_index + 1}/{rounds}"
                bar.update(task, description=f"[bold]{label}[/bold]",
                           left=f"{len(plan) - index - 1} left")
                if config in failed:
                    bar.advance(task)
                    continue
                _log.info("run %s: measuring %s", run_id, label)
                first = config not in probed
                outcome = run_in_workers(
                    config, round_index=round_index, probe=first, profile=profile,
                    trace_dir=trace_dir_of(config, trace_root) if first and trace_root is not None
                    else None)
                if isinstance(outcome, RunFailure):
                    _log.error("%s failed (exit code %d); the end of its error output:\n%s",
                               label, outcome.exit_code, outcome.stderr_tail)
                    failed[config] = outcome
                else:
                    ledger.append(dataclasses.replace(
                        outcome, run_id=run_id, rounds_planned=rounds,
                        injected_faults=injected_faults(os.environ)))
                    probed.add(config)
                bar.advance(task)
        except KeyboardInterrupt:
            # What was measured is in the ledger already; say how much, so that a cut-short run
            # is not later read as a whole one.
            bar.stop()
            (console or Console(stderr=True)).print(
                f"interrupted: run {run_id} recorded {len(ledger.measurements(run_id=run_id))} of "
                f"its {len(plan)} planned launches in {db}; a result's rounds column counts the "
                "rounds it holds (dspark bench list)", highlight=False)
            raise
        bar.update(task, description=f"done: {len(probed)} measured, {len(failed)} failed", left="")
        ledger.verify()  # rows the hash chain does not vouch for are no evidence of noise
        results = annotate(ledger.results(run_id=run_id), history=ledger)
    if failures is not None:
        failures.extend(failed.values())
    elif failed:
        raise BenchRunError(list(failed.values()))
    return results
