"""docs/figures.md and the README's headline table, generated from kept artifacts (``make figures``).

[Note: figures from artifacts]
A published figure is only as good as the record behind it. Every number in docs/figures.md and in
the README's headline table is rendered here from an artifact under ``benchmarks/results/<date>-<machine>/``:
``artifact.json`` (the title, the exact command that measured it, the commit, the machine, and what
it keeps: a ``dspark bench`` run's ledger rows under ``"ledger"``, see [Note: kept rows], a
benchmark's own tables under ``"tables"``, see [Note: table artifacts], or, for artifacts kept
before ledgers were, exported result rows under ``"results"``) beside those files. Before anything
is rendered, every artifact is verified against the chain head pinned for it in
``benchmarks/results/HEADS`` and every result checked against its own figures (see [Note: pinned
heads] in :mod:`dspark.bench.artifacts.kept`); one that fails is refused by name and nothing is
written. Results are rendered as analysed now, from the kept rows: ``--check`` re-derives every
number and compares. ``tests/bench/test_figures.py`` fails on any difference, and on any number in
a table that no artifact value renders to. A figure without an artifact is not published;
:data:`NOT_REMEASURED` names the command that would measure it again.

What each artifact lacks to be re-made is said under it: measured with uncommitted changes (not
reproducible), no ``dspark env`` kept, no load recorded. The README's headline is chosen by
:func:`headline_artifact`'s rule, never by hand.

Each section has a stable anchor (``"anchor"`` in ``artifact.json``, else the directory's name) that
the other docs link to (``figures.md#startup-time``); a re-measurement kept under the same anchor
takes it over from the older artifact, and a figure not re-measured yet keeps its anchor on its line
under "Not re-measured" until an artifact with that anchor is kept, so the links hold.

Example::

    python -m dspark.bench.figures            # verify every artifact, rewrite figures.md and the README's table
    python -m dspark.bench.figures --check    # verify and re-derive; exit 1 when either differs
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dspark.bench.artifacts.kept import (
    HEADS_FILE,
    ArtifactRefused,
    check_artifact,
    pin_artifact,
    read_heads,
)
from dspark.bench.artifacts.table import Table, markdown_table

__all__ = ["NOT_REMEASURED", "REFERENCE_MACHINE", "Artifact", "headline_artifact", "headline_block",
           "load_artifacts", "main", "render_figures", "replace_headline", "unsupported_numbers"]

HEADLINE_START = "<!-- figures:headline:start -->"
HEADLINE_END = "<!-- figures:headline:end -->"

NOT_REMEASURED: tuple[tuple[str, str, str], ...] = (
    ("one-gpu-vs-pytorch", "one GPU beside plain PyTorch", "OUT=DIR bash benchmarks/gpu_session.sh"),
)
"""Figures published before they had a kept artifact: ``(anchor, what, command)``, dropped from the
docs, with the command that measures them. An entry whose anchor a kept artifact has is not listed."""


REFERENCE_MACHINE = (2, "no GPU")
"""The machine the headline is measured on: ``(logical cores, GPU)`` as its ``artifact.json``'s
machine line says them, the 2-core CPU VM the project's CI and ``make bench`` target (any CPU model:
the headline names it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Artifact:
    """One kept measurement: ``benchmarks/results/<name>/artifact.json`` and its rows, verified."""

    name: str
    title: str
    command: str
    commit: str
    machine: str
    notes: str
    rows: tuple[dict[str, Any], ...]
    """Results as analysed now from the kept rows (see [Note: consistent results])."""
    anchor: str = ""
    """The section's HTML anchor in docs/figures.md (links: ``figures.md#ANCHOR``)."""
    tables: tuple[Table, ...] = ()
    """Tables written by the benchmark itself (see [Note: table artifacts])."""
    head: str = ""
    """The chain head pinned for it in ``benchmarks/results/HEADS`` (see [Note: pinned heads])."""
    verified: str = ""
    """What was verified against that head."""
    provenance: tuple[str, ...] = ()
    """What keeps it from being re-made exactly, or complete (see [Note: figures from artifacts])."""
    load: float | None = None
    """The 1-minute load average right after the run (``output.txt`` ends with ``uptime``)."""


_LOAD = re.compile(r"load average: ([\d.]+)")


def _provenance(directory: Path, meta: dict[str, Any]) -> tuple[list[str], float | None]:
    notes = []
    if "uncommitted" in meta["commit"] or meta.get("not_reproducible"):
        why = meta.get("not_reproducible") or ("measured with uncommitted changes, which were not "
                                                "kept: the code that ran is unknown")
        notes.append(f"**not reproducible**: {why}")
    if not (directory / "machine.txt").is_file():
        notes.append("no `dspark env` (machine.txt) was kept")
    output = directory / "output.txt"
    loads = _LOAD.findall(output.read_text(errors="replace")) if output.is_file() else []
    if not loads:
        notes.append("the machine's load was not recorded (no `uptime` after the run)")
    if meta.get("chained"):
        notes.append(f"chained {meta['chained']}")
    return notes, float(loads[-1]) if loads else None


def load_artifacts(results_dir: Path) -> list[Artifact]:
    """Every ``<results_dir>/*/artifact.json``, by directory name, each verified against its head
    pinned in ``results_dir/HEADS`` and its results checked (:func:`check_artifact`): one that fails
    is an :class:`ArtifactRefused` naming it (all that fail, a line each). Artifacts that share an
    anchor are measurements of one thing: the newest (the last directory by name, ``<date>-...``)
    keeps the anchor, so the docs' links reach the latest figures, and each older one is anchored by
    its directory's name."""
    heads = read_heads(Path(results_dir))
    artifacts, refused = [], []
    for meta_path in sorted(Path(results_dir).glob("*/artifact.json")):
        directory = meta_path.parent
        try:
            meta = json.loads(meta_path.read_text())
            if not meta.get("results") and not meta.get("tables") and not meta.get("ledger"):
                raise ArtifactRefused(f"{directory.name}: names no \"ledger\", \"results\" or \"tables\"")
            checked = check_artifact(directory, meta, heads.get(directory.name))
        except ArtifactRefused as exc:
            refused.append(str(exc))
            continue
        except (ValueError, KeyError) as exc:
            refused.append(f"{directory.name}: {type(exc).__name__}: {exc}")
            continue
        notes, load = _provenance(directory, meta)
        artifacts.append(Artifact(
            name=directory.name, title=meta["title"], command=meta["command"], commit=meta["commit"],
            machine=meta["machine"], notes=meta.get("notes", ""), rows=checked.rows,
            anchor=meta.get("anchor") or directory.name, tables=checked.tables, head=checked.head,
            verified=checked.verified, provenance=tuple(notes), load=load))
    stray = sorted(set(heads) - {p.parent.name for p in Path(results_dir).glob("*/artifact.json")})
    refused += [f"{name}: pinned in {HEADS_FILE} but not kept (a kept artifact is never removed)"
                for name in stray]
    if refused:
        raise ArtifactRefused("\n".join(refused))
    newest = {a.anchor: a.name for a in artifacts}
    artifacts = [a if newest[a.anchor] == a.name else replace(a, anchor=a.name) for a in artifacts]
    anchors = [a.anchor for a in artifacts]
    if len(set(anchors)) != len(anchors):
        raise ValueError(f"artifacts in {results_dir} share an anchor with another's directory name: "
                         f"{sorted(x for x in anchors if anchors.count(x) > 1)}")
    return artifacts


_CORES = re.compile(r"(\d+) logical cores")


def _cores(artifact: Artifact) -> int | None:
    found = _CORES.search(artifact.machine)
    return int(found.group(1)) if found else None


def _quiet(artifact: Artifact) -> bool:
    """No row flagged ``busy_machine``, and a load right after the run of at most the core count."""
    cores = _cores(artifact)
    return (bool(artifact.rows) and cores is not None and artifact.load is not None
            and artifact.load <= cores
            and not any(a.get("kind") == "busy_machine" for row in artifact.rows
                        for a in row.get("anomalies", [])))


def headline_artifact(artifacts: list[Artifact]) -> Artifact | None:
    """The README's headline, by rule: the newest (by directory name) artifact of ``make bench``'s
    quick suite (``dspark bench --suite quick``) measured quiet (see :func:`_quiet`) on the
    :data:`REFERENCE_MACHINE`; None when there is none.

    Example::

        headline_artifact(load_artifacts(Path("benchmarks/results"))).name
    """
    cores, gpu = REFERENCE_MACHINE
    chosen = [a for a in artifacts if "--suite quick" in a.command and _cores(a) == cores
              and gpu in a.machine and _quiet(a)]
    return max(chosen, key=lambda a: a.name) if chosen else None


def _cpu(artifact: Artifact) -> str:
    return artifact.machine.split(" (", 1)[0].split(",", 1)[0]


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
    headline = headline_artifact(artifacts)
    out = ["# Figures", "", "[Back to the README](../README.md#figures)", "",
           "<!-- Generated by `make figures` from benchmarks/results/*/artifact.json: do not edit. -->",
           "",
           "Every table here is rendered from a kept artifact in "
           "`benchmarks/results/<date>-<machine>/`: a `dspark bench` run's ledger rows with their "
           "hashes (`ledger.jsonl`), or the table a benchmark wrote (`--out DIR`), with the exact "
           "command, the commit and the machine. `make figures` verifies every artifact against the "
           f"chain head pinned for it in `benchmarks/results/{HEADS_FILE}` (a tracked file: git's "
           "history shows any head that changed) and checks every result against its own steps (a "
           "median inside its p10-p90 and equal to its steps' median, a speedup equal to what its "
           "rounds' steps give); it refuses, by name, an artifact that fails, and renders the results "
           "as the lab's current rules analyse the kept rows. To re-derive every number here yourself: "
           "`python -m dspark.bench.figures --check`; one ledger artifact: `dspark bench verify --db "
           "benchmarks/results/NAME/ledger.jsonl --head HASH` and `dspark bench list --db ...`.", "",
           "Step times are medians over every timed step of every round; a speedup pairs each "
           "N-device round with the 1-device round of the same run (rounds min-max in brackets). "
           "Compare ratios measured in one run, not milliseconds across runs or machines. An anomaly "
           "named in a row is the lab's own verdict on it: `busy_machine` means other processes took "
           "time from the ranks, `suspect_baseline` that the 1-device baseline is unsteady or slower "
           "than N devices allow, so that row's times are not trustworthy (see "
           "[bench.md](bench.md#what-the-lab-cannot-see)). What keeps an artifact from being re-made "
           "exactly is said under it.", "",
           "The README's headline is chosen by rule: the newest artifact of `make bench`'s quick "
           "suite measured quiet (no row flagged `busy_machine`, a load average right after the run "
           f"of at most its core count) on the reference machine, a {REFERENCE_MACHINE[0]}-core CPU "
           f"VM with {REFERENCE_MACHINE[1]}"
           + (f"; now [{headline.name}](#{headline.anchor})." if headline else "; there is none now."),
           ""]
    for artifact in artifacts:
        out += [f'<a id="{artifact.anchor}"></a>', "", f"## {artifact.title}", "",
                f"- artifact: [`benchmarks/results/{artifact.name}/`](../benchmarks/results/{artifact.name}/)",
                f"- command: `{artifact.command}`",
                f"- commit: `{artifact.commit}`" if "`" not in artifact.commit else
                f"- commit: {artifact.commit}",
                f"- machine: {artifact.machine}" + (f"; load average {artifact.load:.2f} right after"
                                                    if artifact.load is not None else ""),
                f"- verified: {artifact.verified}, chain head `{artifact.head}`",
                *(f"- {note}" for note in artifact.provenance), ""]
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
    """The README's table: step and speedup of :func:`headline_artifact`'s choice, its CPU named."""
    lines = [HEADLINE_START]
    artifact = headline_artifact(artifacts)
    if artifact is not None:
        lines += ["", f"{artifact.title}, on {_cpu(artifact)} ({_cores(artifact)} logical cores; "
                      f"`{artifact.command}`; [artifact](benchmarks/results/{artifact.name}/), chosen "
                      "by [rule](docs/figures.md): the newest quiet quick-suite run on the "
                      "reference machine):", ""]
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
    parser.add_argument("--pin", metavar="NAME",
                        help="chain an artifact kept by hand (no chain.txt, or a ledger.jsonl) and pin "
                             f"its head in benchmarks/results/{HEADS_FILE}; then render as usual")
    args = parser.parse_args(argv)
    results_dir = args.root / "benchmarks" / "results"
    if not results_dir.is_dir() or not (args.root / "README.md").is_file():
        parser.error(f"{str(args.root)!r} holds no benchmarks/results/ and README.md: run it from the "
                     "repository's root, or pass --root ROOT")
    if args.pin:
        print(f"pinned {args.pin}: head {pin_artifact(results_dir, args.pin)}")
    try:
        artifacts = load_artifacts(results_dir)
    except ArtifactRefused as exc:
        for line in str(exc).splitlines():
            print(f"REFUSED {line}", file=sys.stderr)
        print("nothing written: an artifact that fails its chain or its own figures is not rendered",
              file=sys.stderr)
        return 1
    for artifact in artifacts:
        print(f"verified {artifact.name}: {artifact.verified}, head {artifact.head}")
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
    print(f"wrote {figures_path} and the headline table of {readme_path} from {len(artifacts)} "
          f"verified artifact(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
