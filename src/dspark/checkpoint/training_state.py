"""``training_state.json``: every non-tensor value of a saved engine (step count, loss scaler,
the optimizer's param-group hyper-parameters and any non-tensor optimizer state), as JSON. DCP's
files hold tensors only; nothing in a checkpoint is a pickle (see [Note: loading runs no code])."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.checkpoint import json_values
from dspark.checkpoint.manifest import read_manifest, read_verified
from dspark.checkpoint.plain_files import TRAINING_STATE, write_json
from dspark.errors import CheckpointError

__all__ = ["STATE_FILE", "TrainingState", "read_training_state", "write_training_state"]

STATE_FILE = "training_state.json"
_FORMAT = "dspark-training-state"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingState:
    """What an engine needs back besides its tensors."""

    step_count: int
    """Optimizer steps the engine had taken."""
    loss_scale: float | None = None
    """The fp16 loss scale, None without a scaler."""
    loss_scale_good_steps: int | None = None
    """Steps since the scale last changed, None without a scaler."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """Each optimizer param group's hyper-parameters (lr, betas, ...), without its params."""
    optimizer_values: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Parameter name -> its non-tensor optimizer state (tensors are in DCP's files)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """``engine.save(extra=...)``: each object's state (its tensors as references into DCP's files)."""
    rng: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Rank (as a string) -> its Python and NumPy generator states."""
    save_id: str = ""
    """The save that wrote it (see [Note: checkpoint integrity]); "" in a format-2 checkpoint."""

    def __post_init__(self) -> None:
        if isinstance(self.step_count, bool) or not isinstance(self.step_count, int) or self.step_count < 0:
            raise ValueError(f"step_count={self.step_count!r} must be an int >= 0")
        if self.loss_scale is not None and not (isinstance(self.loss_scale, float)
                                                and math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ValueError(f"loss_scale={self.loss_scale!r} must be a positive finite float or None")
        good = self.loss_scale_good_steps
        if good is not None and (isinstance(good, bool) or not isinstance(good, int) or good < 0):
            raise ValueError(f"loss_scale_good_steps={good!r} must be an int >= 0 or None")


def write_training_state(directory: Path, state: TrainingState) -> None:
    """Write ``state`` as ``directory/training_state.json`` (rank 0, into the staging directory);
    ``TypeError`` naming the value when a hyper-parameter or state value is not JSON-able.

    Example::

        write_training_state(Path("/tmp/ck.tmp"), TrainingState(step_count=3))
    """
    payload = {
        "format": _FORMAT,
        "save_id": state.save_id,
        "step_count": state.step_count,
        "loss_scale": json_values.encode(state.loss_scale, "loss_scale"),
        "loss_scale_good_steps": state.loss_scale_good_steps,
        "param_groups": [json_values.encode(group, f"param_groups[{i}]")
                         for i, group in enumerate(state.param_groups)],
        "optimizer_values": {name: json_values.encode(values, f"optimizer state of {name!r}")
                             for name, values in state.optimizer_values.items()},
        "extra": {name: json_values.encode(value, f"extra[{name!r}]") for name, value in state.extra.items()},
        "rng": {rank: json_values.encode(value, f"random state of rank {rank}")
                for rank, value in state.rng.items()},
    }
    write_json(directory / STATE_FILE, payload)


def read_training_state(directory: Path) -> TrainingState:
    """The training state saved in ``directory``; :class:`CheckpointError` naming the file when it
    is missing, not JSON, or holds anything DSpark does not write; :class:`CheckpointIntegrityError`
    when it is not the file this checkpoint's save wrote (checked against its manifest).

    Example::

        read_training_state(Path("ckpt")).step_count   # 200
    """
    path = directory / STATE_FILE
    try:
        raw = json.loads(read_verified(directory, STATE_FILE, read_manifest(directory),
                                       TRAINING_STATE).decode("utf-8"))
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointError(f"{str(directory)!r} has no {STATE_FILE}: it is not a complete "
                              "checkpoint of this DSpark version") from exc
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{str(path)!r} is not JSON DSpark wrote ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); the checkpoint is damaged or was crafted") from exc
    try:
        if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
            raise ValueError(f"no \"format\": {_FORMAT!r}")
        unexpected = set(raw) - {"format", "save_id", "step_count", "loss_scale", "loss_scale_good_steps",
                                 "param_groups", "optimizer_values", "extra", "rng"}
        if unexpected:
            raise ValueError(f"unexpected fields {sorted(unexpected)!r}")
        groups = raw["param_groups"]
        values = raw["optimizer_values"]
        if not isinstance(groups, list) or not isinstance(values, dict):
            raise ValueError("param_groups must be a list and optimizer_values an object")
        decoded_groups = [json_values.decode(g, f"param_groups[{i}]") for i, g in enumerate(groups)]
        if not all(isinstance(g, dict) for g in decoded_groups):
            raise ValueError("every param group must be an object")
        decoded_values = {name: json_values.decode(v, f"optimizer state of {name!r}")
                          for name, v in values.items()}
        if not all(isinstance(v, dict) for v in decoded_values.values()):
            raise ValueError("every parameter's optimizer state must be an object")
        scale = json_values.decode(raw["loss_scale"], "loss_scale")
        extra, rng = raw.get("extra", {}), raw.get("rng", {})
        if not isinstance(extra, dict) or not isinstance(rng, dict):
            raise ValueError("extra and rng must be objects")
        decoded_rng = {rank: json_values.decode(v, f"random state of rank {rank}") for rank, v in rng.items()}
        if not all(isinstance(v, dict) for v in decoded_rng.values()):
            raise ValueError("every rank's random state must be an object")
        return TrainingState(step_count=raw["step_count"],
                             loss_scale=None if scale is None else float(scale),
                             loss_scale_good_steps=raw["loss_scale_good_steps"],
                             param_groups=decoded_groups, optimizer_values=decoded_values,
                             extra={name: json_values.decode(v, f"extra[{name!r}]") for name, v in extra.items()},
                             rng=decoded_rng, save_id=str(raw.get("save_id", "")))
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{str(path)!r} is not a training state DSpark wrote "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc
