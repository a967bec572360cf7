"""The report's figures, drawn with matplotlib's object API and the Agg canvas.

No ``pyplot``: it keeps global state and picks a GUI backend from the environment, while a report
must render the same on a headless box; a bare ``Figure`` saves through Agg and is freed with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dspark.bench.present.formatting import BYTES_PER_MB
from dspark.bench.result import BenchResult
from dspark.errors import MissingExtraError

try:  # the lab's extra: pip install 'dspark[lab]'
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
except ImportError as missing:
    raise MissingExtraError("matplotlib", extra="lab", needed_for="the HTML report's figures") from missing

__all__ = ["ReportFigure", "breakdown_figure", "memory_figure", "report_figures", "speedup_figure",
           "step_time_figure"]

_FLAGGED = "#c0392b"
_HEALTHY = "#2874a6"


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportFigure:
    """A figure with the file stem and the caption the report gives it."""

    name: str
    caption: str
    figure: Figure


def _new_figure(num_bars: int, *, legend: bool) -> Figure:
    # ~1.3 inch per bar keeps the tick labels apart; the legend sits beside the axes.
    width = max(6.0, 1.3 * num_bars + 1.5) + (3.5 if legend else 0.0)
    figure = Figure(figsize=(width, 4.8), layout="constrained")
    FigureCanvasAgg(figure)  # attach the raster canvas explicitly (no pyplot backend lookup)
    return figure


def _batch_words(placement: str) -> str:
    return "batch replicated" if placement == "replicate" else "batch sharded"


def _config_label(result: BenchResult) -> str:
    # one short fact per line: long strategy names (torch-fsdp2) must not run into the next bar
    return (f"{result.workload}\n{result.strategy}\n{result.num_devices} dev, {result.precision}\n"
            f"{_batch_words(result.batch_placement)}")


def _legend_outside(axes: Axes) -> None:
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def speedup_figure(results: Sequence[BenchResult]) -> Figure | None:
    """Speedup against devices, one line per workload/strategy/precision/placement, each point
    the median of its rounds with their min-max as an error bar, and the ideal ``y = x``; None
    when no result carries a speedup.

    Example::

        speedup_figure(annotate(results)).savefig("speedup.png")
    """
    Point = tuple[int, float, float, float]  # devices, speedup, round min, round max
    lines: dict[tuple[str, str, str, str, int], list[Point]] = {}
    for r in results:
        if r.speedup is not None:
            group = (r.workload, r.strategy, r.precision, r.batch_placement, r.global_batch)
            low = r.speedup if r.speedup_min is None else r.speedup_min
            high = r.speedup if r.speedup_max is None else r.speedup_max
            lines.setdefault(group, []).append((r.num_devices, r.speedup, low, high))
    if not lines:
        return None
    figure = _new_figure(0, legend=True)
    axes = figure.add_subplot()
    max_devices = max(point[0] for points in lines.values() for point in points)
    axes.plot([1, max_devices], [1, max_devices], linestyle="--", color="grey", label="ideal")
    for (workload, strategy, precision, placement, batch), points in sorted(lines.items()):
        # Every line starts at its 1-device baseline (speedup 1 by definition), which a
        # replicated-batch line does not hold itself: its baseline is the sharded 1-device run.
        if all(point[0] != 1 for point in points):
            points = [(1, 1.0, 1.0, 1.0), *points]
        ordered = sorted(points)
        devices = [p[0] for p in ordered]
        speedups = [p[1] for p in ordered]
        below = [p[1] - p[2] for p in ordered]
        above = [p[3] - p[1] for p in ordered]
        style = ":" if placement == "replicate" else "-"
        axes.errorbar(devices, speedups, yerr=[below, above], marker="o", linestyle=style,
                      capsize=4, label=f"{workload}, {strategy} {precision}, batch {batch} "
                                       f"{'replicated' if placement == 'replicate' else 'sharded'}")
    axes.set_xlabel("devices")
    axes.set_ylabel("speedup vs 1 device (median of rounds, min-max)")
    axes.set_title("Strong scaling (global batch fixed)")
    axes.set_xticks(sorted({point[0] for points in lines.values() for point in points} | {1}))
    axes.set_ylim(bottom=0)
    _legend_outside(axes)
    return figure


def step_time_figure(results: Sequence[BenchResult]) -> Figure:
    """Median step time per configuration, p10-p90 as error bars; flagged results in red.

    Example::

        step_time_figure(results).savefig("step_time.png")
    """
    figure = _new_figure(len(results), legend=False)
    axes = figure.add_subplot()
    positions = range(len(results))
    below = [max(0.0, r.step_ms - r.step_ms_p10) for r in results]
    above = [max(0.0, r.step_ms_p90 - r.step_ms) for r in results]
    axes.bar(positions, [r.step_ms for r in results], yerr=[below, above], capsize=4,
             color=[_FLAGGED if r.anomalies else _HEALTHY for r in results])
    axes.set_xticks(list(positions), [_config_label(r) for r in results], fontsize="small")
    axes.set_ylabel("step time, ms (median, p10-p90)")
    axes.set_title("Step time per configuration (red: anomalies)")
    return figure


def memory_figure(results: Sequence[BenchResult]) -> Figure:
    """Tensor peak, RSS peak and model-state MB per rank for each configuration, with the
    strategy's expected model state as a black tick where known.

    Example::

        memory_figure(results).savefig("memory.png")
    """
    figure = _new_figure(len(results), legend=True)
    axes = figure.add_subplot()
    width = 0.27
    left = [i - width for i in range(len(results))]
    middle = list(range(len(results)))
    right = [i + width for i in range(len(results))]
    axes.bar(left, [r.peak_bytes_per_rank / BYTES_PER_MB for r in results], width,
             label="tensor peak (one step)")
    axes.bar(middle, [r.peak_rss_bytes_per_rank / BYTES_PER_MB for r in results], width,
             label="RSS peak (whole process)")
    axes.bar(right, [r.model_state_bytes_per_rank / BYTES_PER_MB for r in results], width,
             label="model state")
    expected = [(x, r.model_state_bytes_expected_per_rank / BYTES_PER_MB)
                for x, r in zip(right, results, strict=True)
                if r.model_state_bytes_expected_per_rank > 0]
    if expected:
        xs, ys = zip(*expected, strict=True)
        axes.scatter(xs, ys, marker="_", s=400, color="black", zorder=3,
                     label="model state the strategy needs")
    axes.set_xticks(list(range(len(results))), [_config_label(r) for r in results],
                    fontsize="small")
    axes.set_ylabel("MB per rank")
    axes.set_title("Memory per rank by strategy")
    _legend_outside(axes)
    return figure


# (key, label, colour) of each stacked segment, bottom to top; "other" is filled in below.
_SEGMENTS = (("forward_ms", "forward", "#2874a6"), ("backward_ms", "backward", "#5dade2"),
             ("optimizer_ms", "optimizer", "#27ae60"),
             ("comm_exposed_ms", "comm exposed (waiting)", "#c0392b"),
             ("other_ms", "other in the step (loss, user code)", "#aab7b8"),
             ("data_ms", "data (before the step, outside its time)", "#f5cba7"))


def _segments(phases: dict[str, float]) -> dict[str, float]:
    inside = sum(phases.get(key, 0.0) for key in ("forward_ms", "backward_ms", "optimizer_ms",
                                                  "comm_exposed_ms"))
    return {**phases, "other_ms": max(0.0, phases.get("step_ms", 0.0) - inside)}


def breakdown_figure(results: Sequence[BenchResult]) -> Figure | None:
    """The step breakdown (``dspark bench --profile``): per configuration, a stacked bar per rank
    of its median phases (forward, backward, optimizer, exposed communication, the rest of the
    step, then the data time before it); None when no result has a breakdown.

    Example::

        breakdown_figure(annotate(results)).savefig("breakdown.png")
    """
    shown = [r for r in results if r.phase_ms_by_rank]
    if not shown:
        return None
    num_bars = sum(len(r.phase_ms_by_rank) for r in shown) + len(shown) - 1
    figure = _new_figure(num_bars, legend=True)
    figure.set_figheight(5.6)
    axes = figure.add_subplot()
    positions: list[float] = []
    labels: list[str] = []
    bars: list[dict[str, float]] = []
    x = 0.0
    for result in shown:
        first = x
        for rank, phases in enumerate(result.phase_ms_by_rank):
            positions.append(x)
            labels.append(f"rank {rank}")
            bars.append(_segments(phases))
            x += 1
        group = (f"{result.workload}, {result.strategy}\n{result.num_devices} dev, "
                 f"{result.precision}\n{_batch_words(result.batch_placement)}")
        # the configuration under its ranks' tick labels
        axes.annotate(group, xy=((first + x - 1) / 2, 0), xycoords=("data", "axes fraction"),
                      xytext=(0, -22), textcoords="offset points", ha="center", va="top",
                      fontsize="small", color=_FLAGGED if result.anomalies else "black")
        x += 1  # a gap between configurations
    bottoms = [0.0] * len(bars)
    for key, label, colour in _SEGMENTS:
        heights = [bar.get(key, 0.0) for bar in bars]
        axes.bar(positions, heights, 0.8, bottom=bottoms, label=label, color=colour,
                 hatch="//" if key == "data_ms" else None, edgecolor="white", linewidth=0.5)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axes.set_xticks(positions, labels, fontsize="small")
    axes.set_ylabel("ms per step (median over the timed steps)")
    axes.set_title("Where each rank's step went (configuration in red: anomalies)")
    _legend_outside(axes)
    return figure


def report_figures(results: Sequence[BenchResult]) -> list[ReportFigure]:
    """Every figure of the HTML report, in order.

    Example::

        [f.name for f in report_figures(results)]   # ["speedup", "step_time", "memory"]
    """
    figures = []
    speedup = speedup_figure(results)
    if speedup is not None:
        figures.append(ReportFigure(
            name="speedup", figure=speedup,
            caption="Speedup against the 1-device run of the same run: the median of the rounds' "
                "ratios, bars from their min to max; the dashed line is perfect scaling."))
    figures.append(ReportFigure(
        name="step_time", figure=step_time_figure(results),
        caption="Median step time per configuration; bars span p10-p90 of the timed steps of "
                "every round."))
    figures.append(ReportFigure(
        name="memory", figure=memory_figure(results),
        caption="Tensor peak, process RSS peak and model-state memory per rank; ticks mark the "
                "model state the strategy needs."))
    breakdown = breakdown_figure(results)
    if breakdown is not None:
        without = [r for r in results if r.profiled and not r.phase_ms_by_rank]
        peers = (" PyTorch's peers have no step breakdown: "
                 + "; ".join(f"{r.workload} {r.strategy} {r.num_devices} dev" for r in without)
                 + "." if without else "")
        figures.append(ReportFigure(
            name="breakdown", figure=breakdown,
            caption="Step breakdown per rank (dspark bench --profile): the median of each phase "
                    "of engine.step_stats() over the timed steps. A rank whose compute (forward + "
                    "backward + optimizer) stands above the others' is a straggler; the others "
                    "show its extra time as exposed communication." + peers))
    return figures
