"""The plan's figure: predicted speedup against devices, one line per strategy (matplotlib's object
API on the Agg canvas: no display needed)."""

from __future__ import annotations

from pathlib import Path

from dspark.errors import MissingExtraError
from dspark.planner.table import Plan

try:  # the lab's extra: pip install 'dspark[lab]'
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ImportError as missing:
    raise MissingExtraError("matplotlib", extra="lab", needed_for="the plan's figure (--plot)") from missing

__all__ = ["save_speedup_plot", "speedup_figure"]


def speedup_figure(plan: Plan) -> Figure:
    """Predicted speedup (the fastest 1-device step over each row's step) against devices, per
    strategy, with the ideal line; rows that do not fit are drawn hollow.

    Example::

        speedup_figure(plan).savefig("plan.png")
    """
    if plan.probe.device.startswith("fake:"):  # its steps are only the communication: no speedup
        raise ValueError(
            f"the plan's probe ({plan.probe.device!r}) traced the model on fake tensors (--trace fake, or "
            "auto where a measured step would not fit), which predicts memory and no compute time, so "
            "the plan has no speedup to draw; plot a plan whose probe measured steps (--trace measure)")
    ones = [r.step_ms for r in plan.rows if r.devices == 1]
    base = min(ones) if ones else min(r.step_ms * r.devices for r in plan.rows)
    counts = sorted({r.devices for r in plan.rows})
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.add_subplot()
    axes.plot(counts, counts, color="0.7", linestyle="--", label="ideal")
    for strategy in dict.fromkeys(r.strategy for r in plan.rows):
        rows = sorted((r for r in plan.rows if r.strategy == strategy), key=lambda r: r.devices)
        line, = axes.plot([r.devices for r in rows], [base / r.step_ms for r in rows], marker="o",
                          label=strategy)
        misses = [r for r in rows if not r.fits]
        if misses:
            axes.plot([r.devices for r in misses], [base / r.step_ms for r in misses], "o",
                      markerfacecolor="white", color=line.get_color())
    if counts[-1] / counts[0] >= 8:
        axes.set_xscale("log", base=2)
        axes.set_yscale("log", base=2)
    axes.set_xlabel("devices")
    axes.set_ylabel("predicted speedup over 1 device")
    axes.set_title(f"global batch {plan.global_batch}, {plan.precision}, {plan.interconnect} "
                   "(hollow: does not fit)", fontsize=9)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    return fig


def save_speedup_plot(plan: Plan, path: str | Path) -> Path:
    """Write :func:`speedup_figure` to ``path`` (the format from its suffix: .png, .svg, .pdf)."""
    out = Path(path)
    speedup_figure(plan).savefig(out)
    return out
