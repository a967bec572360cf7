"""Keep a benchmark's output as an artifact: ``python -m dspark.bench.record``.

Runs one benchmark command with ``--out benchmarks/results/NAME`` appended (the script writes its
``table.json`` there, see [Note: table artifacts]), or with ``--ledger`` a ``dspark bench`` run
with ``--db benchmarks/results/NAME/ledger.sqlite`` appended (its rows, hashes included, are kept
as ``ledger.jsonl``, see [Note: kept rows]), keeps what it printed in ``output.txt`` (ending with
``uptime``: the machine's load right after the run), ``dspark env`` in ``machine.txt``, chains what
it keeps and pins the chain's head in ``benchmarks/results/HEADS`` (see [Note: pinned heads]), and
writes ``artifact.json`` with the title, the exact command, ``git rev-parse HEAD`` and a one-line
machine summary. A tree with uncommitted changes (outside ``benchmarks/results/``) is recorded as not
reproducible: what ran is not kept. ``make figures`` then renders it in docs/figures.md under its
anchor.

Example::

    python -m dspark.bench.record --name 2026-12-06-xeon-2vcpu-startup --anchor startup-time \\
        --title "Start-up: dspark run beside torchrun" -- .venv/bin/python benchmarks/startup_time.py
    python -m dspark.bench.record --ledger --name 2026-12-06-xeon-2vcpu-seed --anchor seed \\
        --title "The seed suite" -- .venv/bin/dspark bench --suite seed --no-progress
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from dspark.bench.artifacts.kept import LEDGER_FILE, chain_kept_files, pin_head
from dspark.bench.ledger.ledger import Ledger

__all__ = ["machine_line", "main", "record"]


def machine_line(env: dict[str, Any]) -> str:
    """One line for ``artifact.json`` from ``dspark env --json``'s output.

    Example::

        machine_line(env)   # "<CPU model> (x86_64), 2 logical cores, <memory> GiB, no GPU, ..."
    """
    cpu, versions = env.get("cpu", {}), env.get("versions", {})
    gpus = env.get("cuda_devices") or []
    gpu_text = (", ".join(f"{g['name']} ({g['total_memory_bytes'] / 2**20:.0f} MiB)" for g in gpus)
                if gpus else "no GPU")
    total = (env.get("memory") or {}).get("total_bytes")
    memory = f"{total / 2**30:.1f} GiB" if total else "memory unknown"
    return (f"{cpu.get('model', '?')} ({cpu.get('arch', '?')}), {cpu.get('logical_cores', '?')} "
            f"logical cores, {memory}, {gpu_text}, PyTorch {versions.get('torch', '?')}, Python "
            f"{versions.get('python', '?')} (machine.txt: `dspark env`)")


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is under it (``.venv/bin/dspark``), as a
    command in ``artifact.json`` should read on any clone."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


_UNCOMMITTED = "measured with uncommitted changes, which were not kept: the code that ran is unknown"


def record(*, results_dir: Path, name: str, title: str, command: list[str], anchor: str = "",
           notes: str = "", ledger: bool = False) -> Path:
    """Run ``command`` with ``--out results_dir/name`` and keep the artifact there, its chain's head
    pinned in ``results_dir/HEADS``; a command that fails, or writes no ``table*.json``, is a
    ``RuntimeError`` naming it (nothing is published). An existing artifact of that name is a
    ``ValueError``: a kept measurement is never overwritten.

    ``ledger=True`` is for a ``dspark bench`` run: it gets ``--db results_dir/name/ledger.sqlite``
    instead, and the whole ledger (one run's rows, hashes included) is kept as ``ledger.jsonl``
    (``dspark bench export --rows``, which verifies the chain first); the SQLite file is removed."""
    out_dir = results_dir / name
    if (out_dir / "artifact.json").exists():
        raise ValueError(f"{out_dir / 'artifact.json'} exists: pick another --name (a kept artifact "
                         f"is not overwritten)")
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = _run(["git", "rev-parse", "HEAD"]).strip()
    dirty = bool(_run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                       f":!{results_dir}"]).strip())
    db = out_dir / "ledger.sqlite"
    full = [*command, "--db", str(db)] if ledger else [*command, "--out", str(out_dir)]
    dspark = _shown(Path(sys.executable).with_name("dspark"))
    with open(out_dir / "output.txt", "w") as log:
        log.write(f"$ {shlex.join(full)}\n")
        log.flush()
        done = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT, check=False)
        log.write(f"$ uptime\n{_run(['uptime'])}")
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(full)} exited {done.returncode}: see {out_dir / 'output.txt'}")
    meta: dict[str, Any] = {"title": title, "anchor": anchor or name, "commit": commit,
                            "machine": "", "notes": notes}
    if ledger:
        export = [dspark, "bench", "export", "--db", str(db), "--rows", str(out_dir / LEDGER_FILE)]
        with Ledger(db, create=False) as run_ledger:   # what `export` does, in this process
            run_ledger.require_intact(run_ledger.verify())
            run_ledger.export_rows(out_dir / LEDGER_FILE)
        with Ledger(out_dir / LEDGER_FILE) as kept:
            head = kept.verify().head
        db.unlink()
        meta.update(command=f"{shlex.join(full)} && {shlex.join(export)}", ledger=LEDGER_FILE)
    else:
        tables = sorted(p.name for p in out_dir.glob("table*.json"))
        if not tables:
            raise RuntimeError(f"{shlex.join(full)} wrote no table*.json into {out_dir}: does it "
                               f"take --out DIR?")
        meta.update(command=shlex.join(full), tables=tables)
        head = chain_kept_files(out_dir, meta)
    if dirty:
        meta["not_reproducible"] = _UNCOMMITTED
    (out_dir / "machine.txt").write_text(_run([dspark, "env"]))
    meta["machine"] = machine_line(json.loads(_run([dspark, "env", "--json"])))
    (out_dir / "artifact.json").write_text(json.dumps(meta, indent=2) + "\n")
    pin_head(results_dir, name, head)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.bench.record",
                                     description=__doc__.split("\n")[0],
                                     usage="%(prog)s --name NAME --title TITLE [options] -- COMMAND ...")
    parser.add_argument("--name", required=True, help="the directory under --results-dir, "
                        "<date>-<machine>-<what>")
    parser.add_argument("--title", required=True, help="the section's title in docs/figures.md")
    parser.add_argument("--anchor", default="", help="the section's stable anchor (default: --name)")
    parser.add_argument("--notes", default="", help="a paragraph under the title: how to read it")
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--ledger", action="store_true", help="COMMAND is a `dspark bench` run: "
                        "give it --db DIR/ledger.sqlite and keep its exported rows (results.json)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --")
    out_dir = record(results_dir=args.results_dir, name=args.name, title=args.title, command=command,
                     anchor=args.anchor, notes=args.notes, ledger=args.ledger)
    print(f"kept {out_dir}, its chain head pinned in {args.results_dir / 'HEADS'}: run `make figures`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
