"""Results in the terminal (rich tables) and, through :mod:`dspark.bench.present.html_report`, as HTML.

Renderers only render: they print what the results carry (speedup, anomalies), so pass results
through :func:`dspark.bench.analyse.analysis.annotate` first. Every figure printed comes from a result.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dspark.bench.analyse.anomalies import devices
from dspark.bench.analyse.compare import Comparison
from dspark.bench.faults import describe_injected
from dspark.bench.present.formatting import (
    BREAKDOWN_COLUMNS,
    BREAKDOWN_NOTE,
    BYTES_PER_MB,
    MEMORY_COLUMNS_NOTE,
    PEER_COLUMNS,
    PEER_NOTE,
    PEER_TEXT_COLUMNS,
    RESULT_COLUMNS,
    TEXT_COLUMNS,
    anomaly_kinds,
    breakdown_rows,
    config_label,
    format_number,
    format_ratio,
    format_speedup,
    peer_rows,
    result_cells,
)
from dspark.bench.present.html_report import write_html_report
from dspark.bench.result import BenchResult

__all__ = ["render_breakdown_table", "render_comparison", "render_peer_table", "render_results_table",
           "render_seed_table", "write_html_report"]

_VERDICT_STYLE = {"faster": "green", "slower": "bold red", "within noise": "dim",
                  "only in A": "yellow", "only in B": "yellow"}


def _print_messages(console: Console, results: Sequence[BenchResult]) -> None:
    for result in results:
        for anomaly in result.anomalies:
            label = config_label(result)
            console.print(Text.assemble(("! ", "bold red"), (f"{anomaly.get('kind')} ", "bold"),
                                        (f"[{label}] ", "dim"), str(anomaly.get("message", ""))))


def render_results_table(results: Sequence[BenchResult], console: Console | None = None) -> None:
    """One row per result, then every anomaly's message under the table.

    Example::

        render_results_table(annotate(results), Console())
    """
    console = console or Console()
    table = Table(title="DSpark benchmark results", title_justify="left")
    for column in RESULT_COLUMNS:
        if column == "anomalies":
            table.add_column(column, style="bold red", no_wrap=True)
        else:
            table.add_column(column, justify="left" if column in TEXT_COLUMNS else "right")
    for r in results:
        # One kind per line keeps the widest column narrow.
        table.add_row(*result_cells(r)[:-1], "\n".join(anomaly_kinds(r)) or "-")
    console.print(table)
    console.print(Text(MEMORY_COLUMNS_NOTE, style="dim"))
    _print_messages(console, results)


def render_breakdown_table(results: Sequence[BenchResult], console: Console | None = None) -> bool:
    """The step breakdown of every profiled result (``dspark bench --profile``), one row per rank;
    prints nothing and returns False when no result was profiled.

    Example::

        render_breakdown_table(annotate(results), Console())
    """
    rows = [row for r in results for row in breakdown_rows(r)]
    if not rows:
        return False
    console = console or Console()
    table = Table(title="Step breakdown per rank (median ms)", title_justify="left")
    for column in BREAKDOWN_COLUMNS:
        table.add_column(column, justify="left" if column in ("configuration", "host") else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(Text(BREAKDOWN_NOTE, style="dim"))
    return True


def render_peer_table(results: Sequence[BenchResult], console: Console | None = None) -> bool:
    """DSpark beside its peers: one row per pairing measured on 2 or more devices (``replicate``
    and DDP, ``zero1``/``zero2`` and DeepSpeed, ``zero3`` and FSDP2 and DeepSpeed ZeRO-3) with the
    step ratio; prints nothing and returns False when ``results`` hold no pairing.

    Example::

        render_peer_table(annotate(results), Console())
    """
    rows = peer_rows(results)
    if not rows:
        return False
    console = console or Console()
    table = Table(title="DSpark beside its peers", title_justify="left")
    for column in PEER_COLUMNS:
        table.add_column(column, justify="left" if column in PEER_TEXT_COLUMNS
                         else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(Text(PEER_NOTE, style="dim"))
    return True


def _find(results: Sequence[BenchResult], group: tuple[str, str, str, int], num_devices: int,
          placement: str) -> BenchResult | None:
    found = [r for r in results if (r.workload, r.strategy, r.precision, r.global_batch) == group
             and r.num_devices == num_devices and r.batch_placement == placement]
    return found[-1] if found else None


def _verdict_line(label: str, result: BenchResult | None) -> Text:
    if result is None:
        return Text(f"{label}: not measured", style="dim")
    if result.anomalies or result.injected_faults:
        return Text.assemble((f"{label}: ", "bold"), ("FLAGGED", "bold red"),
                             f" ({', '.join(anomaly_kinds(result))})")
    if result.speedup is None or result.efficiency is None:
        return Text.assemble((f"{label}: ", "bold"), ("healthy", "bold green"),
                             " (no 1-device baseline to compare with)")
    scaling = f" ({format_speedup(result)}, efficiency {result.efficiency:.0%})"
    return Text.assemble((f"{label}: ", "bold"), ("healthy", "bold green"), scaling)


def render_seed_table(results: Sequence[BenchResult], console: Console | None = None, *,
                      messages: bool = True) -> None:
    """The seed article's table: per workload, step ms on 1 device, on N with the batch
    replicated (the bug, with its "speedup" below one) and sharded (the fix), and the fixed speedup
    (the median of the rounds' ratios, with their min-max); then each N-device run's anomaly
    verdict, with the messages unless ``messages=False`` (printed already, with the results table).

    Example::

        render_seed_table(annotate(seed_suite_results))
    """
    console = console or Console()
    groups = list(dict.fromkeys((r.workload, r.strategy, r.precision, r.global_batch)
                                for r in results))
    rows = [(group, n) for group in groups for n in sorted(
        {r.num_devices for r in results
         if (r.workload, r.strategy, r.precision, r.global_batch) == group and r.num_devices > 1})]
    sizes = sorted({n for _, n in rows})
    n_label = devices(sizes[0]) if len(sizes) == 1 else "N devices"
    show_devices = len(sizes) != 1  # one N: it is in the headers already
    # What all rows share goes in the title; what differs qualifies each row's name.
    words = [(f"{group[1]} strategy", group[2], f"global batch {group[3]}") for group in groups]
    shared = [i for i in range(3) if len({w[i] for w in words}) == 1]
    title = ", ".join(words[0][i] for i in shared) if words else ""
    table = Table(title=f"Step time (ms){': ' + title if title else ''}", title_justify="left")
    table.add_column("workload")
    if show_devices:
        table.add_column("devices", justify="right")
    for header in ("1 device", f"{n_label}, bug (batch replicated)",
                   f"{n_label}, fixed (sharded)", "speedup fixed / 1 (rounds min-max)"):
        table.add_column(header, justify="right")
    verdicts: list[Text] = []
    for group, num_devices in rows:
        one = _find(results, group, 1, "shard")
        bug = _find(results, group, num_devices, "replicate")
        fixed = _find(results, group, num_devices, "shard")
        varying = [w for i, w in enumerate(words[groups.index(group)]) if i not in shared]
        name = group[0] + (f" ({', '.join(varying)})" if varying else "")
        cells = [format_number(r.step_ms) if r else "-" for r in (one, bug, fixed)]
        if bug is not None and bug.speedup is not None:  # the bug's "speedup": below one
            cells[1] += f" ({format_ratio(bug.speedup)})"
        ratio = format_speedup(fixed) if fixed else "-"
        table.add_row(name, *([str(num_devices)] if show_devices else []), *cells, ratio)
        prefix = f"{name}, {devices(num_devices)}"
        verdicts += [_verdict_line(f"{prefix}, replicated batch", bug),
                     _verdict_line(f"{prefix}, sharded", fixed)]
    console.print(table)
    for line in verdicts:
        console.print(line)
    flagged = [r for r in results if r.num_devices > 1 and (r.anomalies or r.injected_faults)]
    if flagged and messages:
        _print_messages(console, flagged)


def render_comparison(comparison: Comparison, console: Console | None = None) -> None:
    """A row per configuration: A and B step ms, the change, the verdict, the memory change.

    Example::

        render_comparison(compare(ledger.resolve("previous"), ledger.resolve("latest")))
    """
    console = console or Console()
    a, b = comparison.a_label, comparison.b_label
    table = Table(title=f"{b} vs {a}", title_justify="left")
    table.add_column("configuration")
    for header in (f"{a} step ms", f"{b} step ms", "delta", "noise band", "verdict",
                   "peak MB/rank delta"):
        table.add_column(header, justify="right")
    sources: dict[str, str] = {}
    for row in comparison.rows:
        workload, num_devices, strategy, precision, placement, global_batch = row.key
        tag = ""
        if row.noise_band_source:
            tag = f" [{sources.setdefault(row.noise_band_source, str(len(sources) + 1))}]"
        injected = ", ".join(describe_injected(r) for r in (row.a, row.b)
                             if r is not None and r.injected_faults)
        delta = row.delta_pct
        band = row.noise_band
        peak = row.peak_bytes_delta
        table.add_row(
            f"{workload} {num_devices} dev {strategy} {precision} {placement} {global_batch}"
            + (f" [{injected}]" if injected else ""),
            "-" if row.a_step_ms is None else format_number(row.a_step_ms),
            "-" if row.b_step_ms is None else format_number(row.b_step_ms),
            "-" if delta is None else f"{delta:+.1f}%",
            "-" if band is None else f"±{band:.0%}{tag}",
            Text(row.verdict, style=_VERDICT_STYLE.get(row.verdict, "")),
            "-" if peak is None else f"{peak / BYTES_PER_MB:+.1f}")
    console.print(table)
    for source, number in sources.items():
        console.print(Text(f"noise band [{number}]: {source}", style="dim"))
    counts = {v: len(comparison.by_verdict(v)) for v in _VERDICT_STYLE}
    console.print(", ".join(f"{count} {verdict}" for verdict, count in counts.items()))
