"""Running a suite: each configuration in fresh worker processes, then analysis and the ledger.

Every configuration gets its own job through :mod:`dspark.launcher` (PyTorch's launcher
underneath): one process per device, so no state (allocator caches, process groups, warm
kernels) leaks from one measurement into the next. A configuration that fails is reported with
the tail of its stderr and recorded nowhere; the others still run.

[Note: a busy machine] On CPU one device is one core, so any other process that runs during a
measurement steals time from a rank and the step times lie. The runner counts the CPU time the
whole machine spent while a configuration ran (``/proc/stat``) minus what this process and its
workers spent (``getrusage``); when other processes kept more than a small share of the cores
busy, the result carries a ``busy_machine`` anomaly instead of passing as a clean measurement.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import resource
import secrets
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from dspark.bench.analysis import annotate
from dspark.bench.ledger import Ledger
from dspark.bench.result import BenchConfig, BenchResult
from dspark.bench.worker import error_path
from dspark.errors import DSparkError
from dspark.launcher import LaunchSpec, launch

__all__ = ["BUSY_CORES_BASE", "BUSY_CORES_PER_CORE", "BenchRunError", "RunFailure",
           "busy_machine_anomalies", "describe_config", "new_run_id", "run_in_workers", "run_suite"]

_log = logging.getLogger(__name__)

_WORKER_MODULE = "dspark.bench.worker"
_STDERR_TAIL_LINES = 25
# Lines PyTorch's profiler (kineto) writes on every start and stop; they bury a real error.
_NOISE_PREFIXES = ("USDT:",)

BUSY_CORES_BASE = 0.15
BUSY_CORES_PER_CORE = 0.05
"""Other processes may keep ``BASE + PER_CORE * cores`` cores busy (0.25 of a 2-core box)
before a result is flagged: background daemons are normal on big machines, not on small ones."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFailure:
    """A configuration whose workers failed: nothing was recorded for it."""

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
    kept = [line for line in text.splitlines() if not line.startswith(_NOISE_PREFIXES)]
    return "\n".join(kept[-lines:])


def busy_machine_anomalies(foreign_cores: float, num_cores: int) -> list[dict[str, Any]]:
    """A ``busy_machine`` anomaly when other processes kept ``foreign_cores`` cores busy on
    average during a measurement, more than the allowance (see :data:`BUSY_CORES_BASE`).

    Example::

        busy_machine_anomalies(0.9, num_cores=2)   # [{"kind": "busy_machine", ...}]
        busy_machine_anomalies(0.05, num_cores=2)  # []
    """
    allowed = BUSY_CORES_BASE + BUSY_CORES_PER_CORE * num_cores
    if foreign_cores <= allowed:
        return []
    return [{"kind": "busy_machine",
             "message": (f"other processes kept {foreign_cores:.2f} of the machine's {num_cores} "
                         f"cores busy while this configuration ran (more than the {allowed:.2f} "
                         "allowed; its own workers are not counted): they took time from the "
                         "ranks, so the step times are not trustworthy; re-run it on a quiet "
                         "machine"),
             "foreign_cores": round(foreign_cores, 3), "num_cpu_cores": num_cores}]


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy, CPU seconds of this process and its
    reaped descendants), or None where ``/proc/stat`` does not exist."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(v) for v in handle.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    busy_s = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    ours = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return busy_s, sum(r.ru_utime + r.ru_stime for r in ours)


def _measured_with_load(config: BenchConfig) -> BenchResult | RunFailure:
    before, start = _cpu_seconds(), time.monotonic()
    outcome = run_in_workers(config)
    after, wall_s = _cpu_seconds(), time.monotonic() - start
    # Under a second the counters' 10 ms ticks are too coarse to tell anything.
    if isinstance(outcome, BenchResult) and before and after and wall_s >= 1.0:
        foreign_cores = ((after[0] - before[0]) - (after[1] - before[1])) / wall_s
        _log.info("%s: other processes kept %.2f cores busy", describe_config(config),
                  foreign_cores)
        outcome.anomalies = [*outcome.anomalies,
                             *busy_machine_anomalies(foreign_cores, os.cpu_count() or 1)]
    return outcome


def run_in_workers(config: BenchConfig) -> BenchResult | RunFailure:
    """Measure one configuration in ``config.num_devices`` fresh worker processes.

    Example::

        outcome = run_in_workers(BenchConfig(workload="gpt2-cpu", num_devices=2, global_batch=4))
        isinstance(outcome, BenchResult)   # False when the workers failed: a RunFailure
    """
    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp:
        out = Path(tmp) / "result.json"
        spec = LaunchSpec(target=_WORKER_MODULE, module=True, nproc=config.num_devices,
                          args=("--config", json.dumps(asdict(config)), "--out", str(out)))
        done = launch(spec, capture=True)
        if done.returncode == 0 and out.is_file():
            return BenchResult.from_dict(json.loads(out.read_text()))
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


def run_suite(configs: Sequence[BenchConfig], *, db: Ledger | str | Path, progress: bool = True,
              run_id: str | None = None, console: Console | None = None,
              failures: list[RunFailure] | None = None) -> list[BenchResult]:
    """Measure each configuration in fresh workers, annotate (speedup, anomalies) against this
    run and the ledger's history, append to the ledger ``db``, and return the results.

    A failed configuration is logged with its stderr tail and left out. Pass a ``failures`` list
    to receive them; without one, :class:`BenchRunError` is raised after the others were
    recorded, so a failure is never silent.

    Example::

        failed: list[RunFailure] = []
        results = run_suite(build_suite("quick"), db=default_db_path(), failures=failed)
    """
    if not configs:
        raise ValueError("configs=[] is empty: there is nothing to run")
    run_id = run_id or new_run_id()
    measured: list[BenchResult] = []
    failed: list[RunFailure] = []
    with _progress_bar(progress, console) as bar:
        task = bar.add_task("starting", total=len(configs), left="")
        for index, config in enumerate(configs):
            label = describe_config(config)
            bar.update(task, description=f"[bold]{label}[/bold]",
                       left=f"{len(configs) - index - 1} left")
            _log.info("run %s: measuring %s", run_id, label)
            outcome = _measured_with_load(config)
            if isinstance(outcome, RunFailure):
                _log.error("%s failed (exit code %d); the end of its error output:\n%s",
                           label, outcome.exit_code, outcome.stderr_tail)
                failed.append(outcome)
            else:
                outcome.run_id = run_id
                measured.append(outcome)
            bar.advance(task)
        bar.update(task, description=f"done: {len(measured)} measured, {len(failed)} failed",
                   left="")
    with _open_ledger(db) as ledger:
        results = annotate(measured, history=ledger) if measured else []
        if results:
            ledger.append(results)
    if failures is not None:
        failures.extend(failed)
    elif failed:
        raise BenchRunError(failed)
    return results
