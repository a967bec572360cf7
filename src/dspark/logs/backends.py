"""The writers behind :class:`dspark.Tracker`, one per backend, each with ``write(values, step)``
and ``close()``. CSV and JSONL need nothing; TensorBoard needs the ``tensorboard`` package (through
``torch.utils.tensorboard``), W&B ``wandb`` and MLflow ``mlflow``, each imported only when asked for.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

__all__ = ["BACKENDS", "Writer", "check_installed", "open_writer"]

BACKENDS = ("csv", "jsonl", "tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Writer(Protocol):
    def write(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_installed(backend: str) -> None:
    """Raise ``ValueError`` for an unknown backend and ``ModuleNotFoundError`` for one whose package
    is missing, naming the install command."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown tracker backend {backend!r}; choose from {', '.join(BACKENDS)}")
    package = _PACKAGES.get(backend)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(f"the {backend!r} tracker backend needs the {package!r} package: "
                                  f"pip install {package} (or leave {backend!r} out of backends=)")


class _Csv:
    """``scalars.csv``, long format (``step,name,value,time``): metrics may come and go between
    calls without rewriting a header."""

    def __init__(self, directory: Path) -> None:
        path = directory / "scalars.csv"
        fresh = not path.exists() or path.stat().st_size == 0
        self._file = path.open("a", newline="")
        self._csv = csv.writer(self._file)
        if fresh:
            self._csv.writerow(["step", "name", "value", "time"])

    def write(self, values: dict[str, float], step: int) -> None:
        now = time.time()
        self._csv.writerows([step, name, repr(value), f"{now:.3f}"] for name, value in values.items())
        self._file.flush()  # a run that dies keeps what it logged

    def close(self) -> None:
        self._file.close()


class _Jsonl:
    """``scalars.jsonl``: one object per ``log`` call, ``{"step": s, "time": t, name: value, ...}``
    (NaN and infinities as strings, which JSON has no numbers for)."""

    def __init__(self, directory: Path) -> None:
        self._file = (directory / "scalars.jsonl").open("a")

    def write(self, values: dict[str, float], step: int) -> None:
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        row.update((k, v if math.isfinite(v) else repr(v)) for k, v in values.items())
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _TensorBoard:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, directory: Path, project: str | None, run_name: str | None,
                 config: dict[str, Any] | None) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_name, dir=str(directory), config=config)

    def write(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class _Mlflow:
    def __init__(self, project: str | None, run_name: str | None, config: dict[str, Any] | None) -> None:
        import mlflow

        self._mlflow = mlflow
        if project is not None:
            mlflow.set_experiment(project)
        self._run = mlflow.start_run(run_name=run_name)
        if config:
            mlflow.log_params(config)

    def write(self, values: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def open_writer(backend: str, directory: Path, *, project: str | None, run_name: str | None,
                config: dict[str, Any] | None) -> Writer:
    """The writer of ``backend`` (checked with :func:`check_installed` first)."""
    if backend == "csv":
        return _Csv(directory)
    if backend == "jsonl":
        return _Jsonl(directory)
    if backend == "tensorboard":
        return _TensorBoard(directory)
    if backend == "wandb":
        return _Wandb(directory, project, run_name, config)
    return _Mlflow(project, run_name, config)
