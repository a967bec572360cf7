"""What the real-data examples (char_gpt.py, digits_resnet.py) share: checkpoints that carry the
data loader's position, an evaluation summed over ranks, and the training curves as a PNG.

Not an example itself: each example imports it from its own folder (a script's folder is on
``sys.path``, also under ``dspark run``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

import dspark
from dspark import comm
from dspark.checkpoint import is_checkpoint


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _extra_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(f"{checkpoint.name}.extra.json")


def save_checkpoint(engine: dspark.Engine, root: Path, extra: dict[str, Stateful], *, keep: int = 2) -> None:
    """``engine.save(root / "step-N")``, the state of ``extra`` (the loader, the curves) as JSON
    beside it, and only the newest ``keep`` checkpoints kept. The JSON is the one part to replace by
    ``engine.save(path, extra=extra)`` once the engine takes ``extra``. Collective: every rank
    calls it."""
    path = root / f"step-{engine.step_count:06d}"
    engine.save(path)
    if dspark.get_world().is_main:
        # written after the checkpoint and renamed into place: a JSON that exists is complete, and
        # its checkpoint too
        tmp = _extra_path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({name: obj.state_dict() for name, obj in extra.items()}))
        os.replace(tmp, _extra_path(path))
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
            _extra_path(old).unlink(missing_ok=True)  # first: a checkpoint without it is incomplete
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def load_checkpoint(engine: dspark.Engine, path: Path, extra: dict[str, Stateful]) -> None:
    """Restore what :func:`save_checkpoint` saved at ``path`` (at any world size), in place."""
    engine.load(path)
    state = json.loads(_extra_path(path).read_text())
    for name, obj in extra.items():
        obj.load_state_dict(state[name])


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete ``step-N`` checkpoint under ``root`` (its extra state written too)."""
    found = sorted(p for p in root.glob("step-*") if is_checkpoint(p) and _extra_path(p).is_file())
    return found[-1] if found else None


def set_cosine_lr(engine: dspark.Engine, *, peak_lr: float, total_steps: int, warmup_steps: int = 0) -> None:
    """Set the learning rate of the engine's next step: a linear warm-up, then a cosine decay to a
    tenth of ``peak_lr``. A function of ``engine.step_count`` alone, so a resumed run continues it."""
    step = engine.step_count
    if step < warmup_steps:
        lr = peak_lr * (step + 1) / warmup_steps
    else:
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        lr = peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def evaluate(engine: dspark.Engine, batches: Iterable[Any],
             measure: Callable[[Any, Any], torch.Tensor]) -> list[float]:
    """Sum ``measure(outputs, targets)`` (a vector of sums, e.g. ``[loss sum, samples]``) over one
    pass of ``batches`` and over every rank, in eval mode; every rank gets the same totals."""
    engine.module.eval()
    total: torch.Tensor | None = None
    for inputs, targets in batches:
        sums = measure(engine(inputs), targets).double()
        total = sums if total is None else total + sums
    engine.module.train()
    if total is None:
        raise ValueError("evaluate() got no batch: the evaluation set is smaller than one global batch")
    comm.all_reduce(total)
    return total.tolist()  # type: ignore[no-any-return]


class Curves:
    """Named series of ``(step, value)`` points, plus the training seconds so far; it has a state
    dict, so it resumes with the run, and draws itself as a PNG."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.train_s = 0.0

    def add(self, name: str, step: int, value: float) -> None:
        self.series.setdefault(name, []).append((step, float(value)))

    def last(self, name: str) -> float:
        return self.series[name][-1][1]

    def state_dict(self) -> dict[str, Any]:
        return {"series": self.series, "train_s": self.train_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.series = {name: [(int(s), float(v)) for s, v in points]
                       for name, points in state["series"].items()}
        self.train_s = float(state["train_s"])

    def plot(self, path: Path, title: str, panels: list[list[str]]) -> None:
        """One panel per list of series names, against the step; written by rank 0 only."""
        if not dspark.get_world().is_main:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, names in zip(axes[0], panels, strict=True):
            for name in names:
                points = self.series.get(name, [])
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, label=name, marker="o" if len(steps) < 30 else None)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
