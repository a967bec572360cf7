"""``dspark.Tracker``: scalars of a training run written from rank 0 to CSV and JSONL (always) and to
TensorBoard, W&B or MLflow (when asked for and installed). Every rank may call it; only rank 0 writes,
so the loop needs no ``if rank == 0``."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from dspark.logs.backends import Writer, check_installed, open_writer
from dspark.logs.console import this_rank

__all__ = ["Tracker"]


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"tracker value {name!r} is a tensor of shape {tuple(value.shape)}; log "
                            "scalars (one number per name)")
        return float(value.detach().float().item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"tracker value {name!r} is a {type(value).__name__}; log numbers or one-element "
                    "tensors")


class Tracker:
    """Scalars of a run, written by rank 0 into ``directory``: ``scalars.csv`` (``step,name,value,
    time``) and ``scalars.jsonl`` always, plus each backend named in ``backends`` ("tensorboard":
    event files in ``directory`` for ``tensorboard --logdir``; "wandb", "mlflow": a run in that
    service, ``project`` its project/experiment, ``config`` its parameters). On other ranks every
    call does nothing. A backend whose package is missing is an error on every rank at construction.

    Example::

        with dspark.Tracker("runs/gpt", backends=("csv", "tensorboard")) as tracker:
            for step in range(steps):
                ...
                tracker.log({"loss": loss, "lr": sched.get_last_lr()[0]}, step=step)
                tracker.log_step_stats(engine, step=step)
    """

    def __init__(self, directory: str | Path, backends: Sequence[str] = ("csv", "tensorboard"), *,
                 project: str | None = None, run_name: str | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        if isinstance(backends, str):
            raise TypeError(f"backends={backends!r}: pass a tuple of names, e.g. ({backends!r},)")
        chosen = ["csv", "jsonl"] + [b for b in backends if b not in ("csv", "jsonl")]
        for backend in chosen:
            check_installed(backend)
        self.directory = Path(directory)
        self.backends = tuple(dict.fromkeys(chosen))
        self._writers: list[Writer] = []
        self._closed = False
        if this_rank() != 0:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        for backend in self.backends:
            self._writers.append(open_writer(backend, self.directory, project=project,
                                             run_name=run_name,
                                             config=dict(config) if config is not None else None))

    def log(self, values: Mapping[str, Any], *, step: int) -> None:
        """Record ``values`` (name -> number or one-element tensor) at ``step``, on rank 0.

        Example::

            tracker.log({"loss": loss, "grad_norm": norm}, step=step)
        """
        if self._closed:
            raise RuntimeError("this Tracker is closed; open a new one to log more")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0")
        if not self._writers:
            return  # not rank 0: nothing to convert (a tensor's .item() would synchronise for nothing)
        scalars = {str(name): _scalar(str(name), value) for name, value in values.items()}
        for writer in self._writers:
            writer.write(scalars, step)

    def log_step_stats(self, engine: Any, *, step: int, prefix: str = "step/") -> None:
        """Log ``engine.step_stats()`` (rank 0's last step in milliseconds: step, forward, backward,
        exposed communication, optimizer, data) as ``step/forward_ms`` and so on.

        Example::

            engine.step()
            tracker.log_step_stats(engine, step=step)
        """
        if not self._writers:
            return
        self.log({f"{prefix}{name}": value for name, value in engine.step_stats().items()}, step=step)

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for writer in self._writers:
            writer.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
