"""What the real-data examples (char_gpt.py, digits_resnet.py) share: numbered checkpoints (the
engine's own, with the loader, the scheduler and the curves as ``extra=`` state), a warm-up + cosine
learning-rate multiplier, an evaluation summed over ranks, and the training curves as a PNG.

Not an example itself: each example imports it from its own folder (a script's folder is on
``sys.path``, also under ``dspark run``).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

import dspark
from dspark import comm
from dspark.checkpoint import is_checkpoint


def save_checkpoint(engine: dspark.Engine, root: Path, extra: Mapping[str, Any], *, keep: int = 2) -> None:
    """``engine.save(root / "step-N", extra=extra)``, then only the newest ``keep`` checkpoints kept.
    Collective: every rank calls it."""
    engine.save(root / f"step-{engine.step_count:06d}", extra=extra)
    if dspark.get_world().is_main:
        # a save is published in one rename, so every step-N that exists is complete; deleting the
        # oldest never touches the one just written
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    comm.barrier()


def latest_checkpoint(root: Path) -> Path | None:
    """The newest ``step-N`` checkpoint under ``root``, or None."""
    found = sorted(p for p in root.glob("step-*") if is_checkpoint(p))
    return found[-1] if found else None


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The learning-rate multiplier of step ``step`` (from 0), for ``torch.optim.lr_scheduler.LambdaLR``:
    a linear warm-up to 1 over ``warmup_steps``, then a cosine decay to 0.1 at ``total_steps``.

    Example::

        LambdaLR(engine.optimizer, functools.partial(warmup_cosine, warmup_steps=30, total_steps=600))
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def no_decay_for_biases_and_norms(name: str, param: torch.nn.Parameter) -> dict[str, Any]:
    """nanoGPT's weight-decay rule, for ``dspark.Engine(param_groups=...)``: matrices and embeddings
    (``ndim >= 2``) decay; biases and norm weights (``ndim < 2``) do not."""
    return {} if param.ndim >= 2 else {"weight_decay": 0.0}


def global_mean(value: torch.Tensor) -> float:
    """The mean of a per-rank scalar over every rank (each rank's loss over its rows -> the global
    batch's loss, when every rank has as many rows). Collective."""
    total = value.detach().double().clone()
    comm.all_reduce(total, op="avg")
    return float(total)


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
