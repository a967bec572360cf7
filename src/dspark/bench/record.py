"""Keep a benchmark's output as an artifact: ``python -m dspark.bench.record``.

Runs one benchmark command with ``--out benchmarks/results/NAME`` appended (the script writes its
``table.json`` there, see [Note: table artifacts]), or with ``--ledger`` a ``dspark bench`` run
with ``--db benchmarks/results/NAME/ledger.sqlite`` appended (its rows are exported to
``results.json``), keeps what it printed in ``output.txt`` (ending
with ``uptime``: the machine's load right after the run), ``dspark env`` in ``machine.txt``, and
writes ``artifact.json`` with the title, the command, ``git rev-parse HEAD`` and a one-line machine
summary. ``make figures`` then renders it in docs/figures.md under its anchor.

Example::

    python -m dspark.bench.record --name 2026-12-06-xeon-2vcpu-startup --anchor startup-time \\
        --title "Start-up: dspark run beside torchrun" -- .venv/bin/python benchmarks/startup_time.py
    python -m dspark.bench.record --ledger --name 2026-12-06-xeon-2vcpu-seed --anchor seed \
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

__all__ = ["machine_line", "main", "record"]


def machine_line(env: dict[str, Any]) -> str:
    """One line for ``artifact.json`` from ``dspark env --json``'s output.

    Example::

        machine_line(env)   # "Intel(R) Xeon(R) Processor (x86_64), 2 cores, 23.6 GiB, no GPU, ..."
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


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def record(*, results_dir: Path, name: str, title: str, command: list[str], anchor: str = "",
           notes: str = "", ledger: bool = False) -> Path:
    """Run ``command`` with ``--out results_dir/name`` and keep the artifact there; a command that
    fails, or writes no ``table*.json``, is a ``RuntimeError`` naming it (nothing is published).
    An existing artifact of that name is a ``ValueError``: a kept measurement is never overwritten.

    ``ledger=True`` is for a ``dspark bench`` run: it gets ``--db results_dir/name/ledger.sqlite``
    instead, and the run's rows are exported from that ledger (``dspark bench export``, which
    verifies its hash chain first) to ``results.json``, what docs/figures.md renders; the ledger
    file itself is not kept (``*.sqlite`` is ignored by git)."""
    out_dir = results_dir / name
    if (out_dir / "artifact.json").exists():
        raise ValueError(f"{out_dir / 'artifact.json'} exists: pick another --name (a kept artifact "
                         f"is not overwritten)")
    out_dir.mkdir(parents=True, exist_ok=True)
    db = out_dir / "ledger.sqlite"
    full = [*command, "--db", str(db)] if ledger else [*command, "--out", str(out_dir)]
    dspark = str(Path(sys.executable).with_name("dspark"))
    with open(out_dir / "output.txt", "w") as log:
        log.write(f"$ {shlex.join(full)}\n")
        log.flush()
        done = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT, check=False)
        log.write(f"$ uptime\n{_run(['uptime'])}")
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(full)} exited {done.returncode}: see {out_dir / 'output.txt'}")
    kept: dict[str, list[str]]
    if ledger:
        export = [dspark, "bench", "export", "--run", "latest", "--db", str(db),
                  "--json", str(out_dir / "results.json")]
        _run(export)
        command_text = f"{shlex.join(full)} && {shlex.join(export)}"
        kept = {"results": ["results.json"]}
    else:
        tables = sorted(p.name for p in out_dir.glob("table*.json"))
        if not tables:
            raise RuntimeError(f"{shlex.join(full)} wrote no table*.json into {out_dir}: does it "
                               f"take --out DIR?")
        command_text = shlex.join(full)
        kept = {"tables": tables}
    (out_dir / "machine.txt").write_text(_run([dspark, "env"]))
    env = json.loads(_run([dspark, "env", "--json"]))
    commit = _run(["git", "rev-parse", "HEAD"]).strip()
    if _run(["git", "status", "--porcelain", "--untracked-files=no"]).strip():
        commit += " (with uncommitted changes)"
    meta: dict[str, Any] = {"title": title, "anchor": anchor or name, "command": command_text,
                            "commit": commit, "machine": machine_line(env), "notes": notes,
                            "headline": False, **kept}
    (out_dir / "artifact.json").write_text(json.dumps(meta, indent=2) + "\n")
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
    print(f"kept {out_dir}: run `make figures`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
