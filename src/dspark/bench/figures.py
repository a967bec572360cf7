"""docs/figures.md and the README's headline table, generated from kept artifacts (``make figures``).

[Note: figures from artifacts]
A published figure is only as good as the record behind it. Every number in docs/figures.md and in
the README's headline table is rendered here from an artifact under ``benchmarks/results/<date>-<machine>/``:
``artifact.json`` (the title, the command that measured it, the commit, the machine, and the files
holding the exported ledger rows, ``dspark bench export --json``, under ``"results"``, or a
benchmark's own tables under ``"tables"``, see [Note: table artifacts]) beside those files. Nothing
is typed by hand: ``tests/bench/test_figures.py`` regenerates both and fails on any difference, and
on any number in a table that no artifact value renders to. A figure without an artifact is not
published; :data:`NOT_REMEASURED` names the command that would measure it again.

Each section has a stable anchor (``"anchor"`` in ``artifact.json``, else the directory's name) that
the other docs link to (``figures.md#startup-time``); a re-measurement kept under the same anchor
takes it over from the older artifact, and a figure not re-measured yet keeps its anchor on its line
under "Not re-measured" until an artifact with that anchor is kept, so the links hold.

Example::

    python -m dspark.bench.figures            # rewrite docs/figures.md and README.md's table
    python -m dspark.bench.figures --check    # exit 1 when either is not what the artifacts give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dspark.bench.table_artifact import Table, load_table, markdown_table

__all__ = ["NOT_REMEASURED", "Artifact", "headline_block", "load_artifacts", "main",
           "render_figures", "replace_headline", "unsupported_numbers"]

HEADLINE_START = "<!-- figures:headline:start -->"
HEADLINE_END = "<!-- figures:headline:end -->"

NOT_REMEASURED: tuple[tuple[str, str, str], ...] = (
    ("peers", "the peers suite: DSpark beside DDP, FSDP2 and DeepSpeed",
     "make peers; dspark bench --suite peers --json peers.json"),
    ("gpt2-124m-memory-per-rank", "GPT-2 124M's memory per rank beside DDP and FSDP2",
     "dspark bench --workloads gpt2-124m --strategies replicate,zero3,torch-ddp,torch-fsdp2 "
     "--devices 2 --global-batch 2 --rounds 1"),
    ("side-by-side", "DSpark and a peer in the same processes, step by step",
     "dspark run --nproc 2 benchmarks/side_by_side.py --workload resnet50-cpu --steps 40"),
    ("cpu-malloc", "the engine's CPU malloc choices",
     "OMP_NUM_THREADS=1 python benchmarks/cpu_malloc.py --workload gpt2-cpu --batch 16"),
    ("shm-collectives", "collectives through shared memory against gloo",
     "dspark run --nproc 2 benchmarks/shm_collectives.py"),
    ("reduce-scatter", "reduce-scatter as one all-to-all on gloo", "dspark run --nproc 2 benchmarks/reduce_scatter.py"),
    ("optimizer-kernel", "the fused optimizer kernel", "OMP_NUM_THREADS=1 python benchmarks/optimizer_kernel.py"),
    ("zero-real-memory", "ZeRO's saving in real memory", "python benchmarks/zero_real_memory.py"),
    ("meta-zero3-rss", "a model over one rank's budget, built on meta",
     "dspark run --nproc 2 benchmarks/meta_zero3_rss.py --budget-gib 3"),
    ("save-stall", "checkpoint save stall, synchronous and asynchronous",
     "dspark run --nproc 2 benchmarks/save_stall.py --params-m 8 --saves 5 --ckpt /tmp/stall-ckpt"),
    ("restart-time", "restart after a killed worker", "python benchmarks/restart_time.py --kills 10"),
    ("observe-overhead", "the step observer's and the batch fingerprint's overhead",
     "dspark run --nproc 2 benchmarks/observe_overhead.py --workload tiny gpt2-cpu --strategy zero2 "
     "--steps 40"),
    ("examples-on-real-data", "the examples on real data",
     "python benchmarks/examples_on_real_data.py"),
    ("one-gpu-vs-pytorch", "one GPU beside plain PyTorch", "OUT=DIR bash benchmarks/gpu_session.sh"),
    ("startup-time", "`dspark run` beside `torchrun --standalone` at start and exit, and `import dspark`",
     ".venv/bin/python benchmarks/startup_time.py --repeats 5"),
    ("async-save-vs-dcp", "DSpark's asynchronous save beside DCP's `async_save`",
     "dspark run --nproc 2 benchmarks/async_save_vs_dcp.py --params-m 8 --saves 5 --ckpt /tmp/stall-ckpt"),
    ("pretrained-load-rss", "peak RSS per rank while pretrained weights load, three ways",
     ".venv/bin/python benchmarks/pretrained_load_rss.py"),
    ("checkpoint-verification-cost", "what a load's manifest check costs, warm and cold page cache",
     "python benchmarks/ckpt_verify_cost.py --repeats 5 --cache both --sha256"),
    ("plan-at-scale", "what `dspark plan` predicts for ResNet-50 and GPT-2 124M on 2 DGX Spark boxes "
     "and on 8 to 256 GPUs (predictions, not measurements)",
     ".venv/bin/python benchmarks/plan_at_scale.py"),
    ("check-scaling", "`dspark check`'s time and peak memory against the file's size",
     "python benchmarks/check_scaling.py"),
    ("batch-check-cost", "the replicated-batch check's cost per step",
     "dspark run --nproc 2 benchmarks/batch_check_cost.py --workload gpt2-cpu --steps 20"),
    ("step-guard-cost", "what the step's guards (`skip_nonfinite`, step tags) cost a step",
     "OMP_NUM_THREADS=1 dspark run --nproc 2 benchmarks/step_guard_cost.py --workload tiny "
     "--strategy zero2 --steps 60"),
)
"""Figures published before they had a kept artifact: ``(anchor, what, command)``, dropped from the
docs, with the command that measures them. An entry whose anchor a kept artifact has is not listed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Artifact:
    """One kept measurement: ``benchmarks/results/<name>/artifact.json`` and its ledger rows."""

    name: str
    title: str
    command: str
    commit: str
    machine: str
    notes: str
    headline: bool
    rows: tuple[dict[str, Any], ...]
    anchor: str = ""
    """The section's HTML anchor in docs/figures.md (links: ``figures.md#ANCHOR``)."""
    tables: tuple[Table, ...] = ()
    """Tables written by the benchmark itself (see [Note: table artifacts])."""


def load_artifacts(results_dir: Path) -> list[Artifact]:
    """Every ``<results_dir>/*/artifact.json``, by directory name; a file it names that is missing,
    or not a JSON list of result rows (``"results"``) or a table (``"tables"``), and an artifact with
    neither are ``ValueError``s naming them. Artifacts that share an anchor are measurements of one
    thing: the newest (the last directory by name, ``<date>-...``) keeps the anchor, so the docs'
    links reach the latest figures, and each older one is anchored by its directory's name."""
    artifacts = []
    for meta_path in sorted(Path(results_dir).glob("*/artifact.json")):
        meta = json.loads(meta_path.read_text())
        if not meta.get("results") and not meta.get("tables"):
            raise ValueError(f"{meta_path}: names no \"results\" (ledger rows) and no \"tables\"")
        for rel in [*meta.get("results", []), *meta.get("tables", [])]:
            if not (meta_path.parent / rel).is_file():
                raise ValueError(f"{meta_path}: file {rel!r} is missing")
        tables = tuple(load_table(meta_path.parent / rel) for rel in meta.get("tables", []))
        rows: list[dict[str, Any]] = []
        for rel in meta.get("results", []):
            path = meta_path.parent / rel
            data = json.loads(path.read_text())
            if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
                raise ValueError(f"{path}: not a JSON list of result rows (dspark bench export --json)")
            rows.extend(data)
        artifacts.append(Artifact(name=meta_path.parent.name, title=meta["title"],
                                  command=meta["command"], commit=meta["commit"],
                                  machine=meta["machine"], notes=meta.get("notes", ""),
                                  headline=bool(meta.get("headline", False)), rows=tuple(rows),
                                  anchor=meta.get("anchor") or meta_path.parent.name, tables=tables))
    newest = {a.anchor: a.name for a in artifacts}
    artifacts = [a if newest[a.anchor] == a.name else replace(a, anchor=a.name) for a in artifacts]
    anchors = [a.anchor for a in artifacts]
    if len(set(anchors)) != len(anchors):
        raise ValueError(f"artifacts in {results_dir} share an anchor with another's directory name: "
                         f"{sorted(x for x in anchors if anchors.count(x) > 1)}")
    return artifacts


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _speedup(row: dict[str, Any]) -> str:
    if row.get("speedup") is None:
        return "-"
    text = f"{row['speedup']:.2f}x"
    if row.get("num_devices", 1) > 1 and row.get("speedup_min") is not None:
        text += f" ({row['speedup_min']:.2f}-{row['speedup_max']:.2f})"
    return text


def _flags(row: dict[str, Any]) -> str:
    kinds = list(dict.fromkeys(a.get("kind", "?") for a in row.get("anomalies", [])))
    injected = row.get("injected_faults") or {}
    words = kinds + [f"injected {name}={value}" for name, value in sorted(injected.items())]
    return ", ".join(words) if words else "none"


def _batch(row: dict[str, Any]) -> str:
    text = f"{row['batch_placement']} {row['global_batch']}"
    if row.get("micro_batches", 1) > 1:
        text += f" ({row['micro_batches']} micro-batches)"
    return text


_COLUMNS = ("workload", "devices", "strategy", "precision", "batch", "rounds",
            "step ms (p10-p90)", "samples/s", "speedup (rounds min-max)", "tensor peak MB/rank",
            "anomalies")


def _cells(row: dict[str, Any]) -> list[str]:
    samples = row.get("samples_per_s")
    return [row["workload"], str(row["num_devices"]), row["strategy"], row["precision"], _batch(row),
            str(row.get("rounds", 1)),
            f"{_ms(row['step_ms'])} ({_ms(row.get('step_ms_p10'))}-{_ms(row.get('step_ms_p90'))})",
            "-" if samples is None else f"{samples:.1f}", _speedup(row),
            f"{row.get('peak_bytes_per_rank', 0) / 1e6:.1f}", _flags(row)]


def _table(rows: tuple[dict[str, Any], ...], columns: tuple[str, ...] = _COLUMNS,
           pick: tuple[int, ...] | None = None) -> list[str]:
    indices = pick if pick is not None else tuple(range(len(columns)))
    lines = ["| " + " | ".join(columns[i] for i in indices) + " |",
             "|" + "---|" * len(indices)]
    ordered = sorted(rows, key=lambda r: (r["workload"], r["strategy"], r["num_devices"],
                                          r["batch_placement"]))
    for row in ordered:
        cells = _cells(row)
        lines.append("| " + " | ".join(cells[i] for i in indices) + " |")
    return lines


def _verdicts(rows: tuple[dict[str, Any], ...]) -> str:
    """One generated line: how many rows the lab flagged, by kind, and what that means for them."""
    counts: dict[str, int] = {}
    for row in rows:
        for kind in dict.fromkeys(a.get("kind", "?") for a in row.get("anomalies", [])):
            counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        return f"The lab flagged none of these {len(rows)} results."
    flagged = "; ".join(f"`{kind}` on {n} of {len(rows)}" for kind, n in sorted(counts.items()))
    line = f"The lab's verdicts: {flagged}."
    if "busy_machine" in counts:
        line += (" A row flagged `busy_machine` ran while other processes took time from its ranks: "
                 "its step times are not trustworthy, and neither is a speedup built on it.")
    return line


def render_figures(artifacts: list[Artifact]) -> str:
    """The whole of docs/figures.md."""
    out = ["# Figures", "", "[Back to the README](../README.md#figures)", "",
           "<!-- Generated by `make figures` from benchmarks/results/*/artifact.json: do not edit. -->",
           "",
           "Every table here is rendered from a kept artifact: the exported ledger rows "
           "(`dspark bench export --json`) or the table a benchmark wrote (`--out DIR`), the "
           "command, the commit and the machine, in "
           "`benchmarks/results/<date>-<machine>/`. Step times are medians over every timed step of "
           "every round; a speedup pairs each N-device round with the 1-device round of the same run "
           "(rounds min-max in brackets). Compare ratios measured in one run, not milliseconds across "
           "runs or machines. An anomaly named in a row is the lab's own verdict on it: "
           "`busy_machine` means other processes took time from the ranks, so that row's times are not "
           "trustworthy (see [bench.md](bench.md#what-the-lab-cannot-see)).", ""]
    for artifact in artifacts:
        out += [f'<a id="{artifact.anchor}"></a>', "", f"## {artifact.title}", "",
                f"- artifact: [`benchmarks/results/{artifact.name}/`](../benchmarks/results/{artifact.name}/)",
                f"- command: `{artifact.command}`",
                f"- machine: {artifact.machine}", ""]
        if artifact.notes:
            out += [artifact.notes, ""]
        if artifact.rows:
            out += [*_table(artifact.rows), "", _verdicts(artifact.rows), ""]
        for table in artifact.tables:
            out += [*markdown_table(table), ""]
    kept = {artifact.anchor for artifact in artifacts}
    out += ['<a id="not-re-measured"></a>', "", "## Not re-measured", "",
            "These figures were published before their output was kept, or have not been measured "
            "since, so they are not shown. Re-measure with the command, keep the output under "
            "`benchmarks/results/` with an `artifact.json` under the anchor given, and run "
            "`make figures`. For a benchmark that writes its own table, "
            "`python -m dspark.bench.record --name DATE-MACHINE-WHAT --anchor ANCHOR --title TITLE "
            "-- COMMAND` does all of it (it appends `--out DIR`):", ""]
    out += [f'- <a id="{anchor}"></a>{what}: re-measure with `{command}` (anchor `{anchor}`)'
            for anchor, what, command in NOT_REMEASURED if anchor not in kept]
    return "\n".join(out) + "\n"


def headline_block(artifacts: list[Artifact]) -> str:
    """The README's table: step and speedup of every artifact marked ``"headline": true``."""
    lines = [HEADLINE_START]
    for artifact in (a for a in artifacts if a.headline):
        lines += ["", f"{artifact.title} (`{artifact.command}`; "
                      f"[artifact](benchmarks/results/{artifact.name}/)):", ""]
        lines += [*_table(artifact.rows, pick=(0, 1, 6, 8, 10)), "", _verdicts(artifact.rows)]
    lines += ["", HEADLINE_END]
    return "\n".join(lines)


def replace_headline(readme: str, block: str) -> str:
    """``readme`` with the text between the headline markers replaced by ``block``; a README
    without both markers is a ``ValueError``."""
    start, end = readme.find(HEADLINE_START), readme.find(HEADLINE_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {HEADLINE_START} ... {HEADLINE_END} markers")
    return readme[:start] + block + readme[end + len(HEADLINE_END):]


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _table_numbers(text: str) -> list[str]:
    numbers = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            numbers += _NUMBER.findall(line)
    return numbers


def unsupported_numbers(text: str, artifacts: list[Artifact]) -> list[str]:
    """Numbers in ``text``'s tables that no artifact row renders to (a hand-typed figure)."""
    known = set(_NUMBER.findall(" ".join(" ".join(_cells(row) + list(_COLUMNS))
                                         for a in artifacts for row in a.rows)))
    known |= set(_NUMBER.findall(" ".join(_COLUMNS)))
    known |= set(_NUMBER.findall(" ".join(" ".join(t.columns) + " " + " ".join(" ".join(r) for r in t.rows)
                                          for a in artifacts for t in a.tables)))
    return [number for number in _table_numbers(text) if number not in known]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.figures", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when docs/figures.md or the README's table differs")
    args = parser.parse_args(argv)
    artifacts = load_artifacts(args.root / "benchmarks" / "results")
    figures_path, readme_path = args.root / "docs" / "figures.md", args.root / "README.md"
    figures = render_figures(artifacts)
    readme = replace_headline(readme_path.read_text(), headline_block(artifacts))
    if args.check:
        stale = [str(p) for p, text in ((figures_path, figures), (readme_path, readme))
                 if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"{path} is not what benchmarks/results/ gives: run `make figures`", file=sys.stderr)
        return 1 if stale else 0
    figures_path.write_text(figures)
    readme_path.write_text(readme)
    print(f"wrote {figures_path} and the headline table of {readme_path} from {len(artifacts)} artifact(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
