"""The examples on real data: examples/char_gpt.py and examples/digits_resnet.py on 1 and 2 ranks.

Run from the repository root::

    python benchmarks/examples_on_real_data.py

Each example runs as a user runs it, ``dspark run --nproc N examples/EXAMPLE.py --out RUN_DIR``,
once per ``--nproc`` value, each with a fresh run directory (no checkpoint to resume from) under a
temporary folder that is removed afterwards: char_gpt for ``--char-gpt-steps`` steps, digits_resnet
for ``--digits-epochs`` epochs, their other sizes the examples' defaults. From each run's final
summary it prints the final validation loss (char_gpt) or test accuracy (digits_resnet), the
example's own training time (first step to last checkpoint, evaluations and saves included), the
speed-up of that time over the first ``--nproc`` value's, and the whole command's time (start-up and
exit included). ``--out DIR`` writes the table as ``DIR/table.json`` for docs/figures.md (see
[Note: table artifacts]); a run's ``--out`` is its own run directory, so this script is what keeps
the figure.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dspark.bench.artifacts.table import write_table

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@dataclass(frozen=True)
class Example:
    name: str
    args: tuple[str, ...]
    metric: str       # the final summary's metric, as it prints it
    per_rank: str     # what its first line counts per rank and step


@dataclass(frozen=True)
class Run:
    metric: str       # as the example printed it
    train_s: float    # the example's own training time
    whole_s: float    # the whole command's
    global_batch: int


def run_example(example: Example, nproc: int, run_dir: Path) -> Run:
    """One ``dspark run`` of ``example`` on ``nproc`` ranks into the fresh ``run_dir``: its final
    metric, training time, rows per rank and step, and the whole command's seconds."""
    command = [sys.executable, "-m", "dspark.cli.main", "run", "--nproc", str(nproc),
               str(EXAMPLES / f"{example.name}.py"), "--out", str(run_dir), *example.args]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    whole_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    final = re.search(rf"^{example.name}: {nproc} rank\(s\), .*{example.metric} ([\d.]+), training time "
                      rf"([\d.]+) s", done.stdout, re.MULTILINE)
    batch = re.search(rf"(\d+) {example.per_rank} each per step", done.stdout)
    if final is None or batch is None:
        raise SystemExit(f"{' '.join(command)}: no final summary in its output:\n{done.stdout[-3000:]}")
    return Run(metric=final.group(1), train_s=float(final.group(2)), whole_s=whole_s,
               global_batch=int(batch.group(1)) * nproc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--char-gpt-steps", type=int, default=200, help="char_gpt's --steps")
    parser.add_argument("--digits-epochs", type=int, default=20, help="digits_resnet's --epochs")
    parser.add_argument("--nproc", default="1,2", help="comma-separated world sizes, each a run")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nproc.split(",")]
    examples = [Example("char_gpt", ("--steps", str(args.char_gpt_steps)), "validation loss", "windows"),
                Example("digits_resnet", ("--epochs", str(args.digits_epochs)), "test accuracy", "images")]
    rows, described = [], []
    runs = Path(tempfile.mkdtemp(prefix="dspark-examples-"))
    try:
        for example in examples:
            first_s = None
            for nproc in sizes:
                got = run_example(example, nproc, runs / f"{example.name}-{nproc}")
                first_s = first_s or got.train_s
                row = [example.name, str(nproc), f"{example.metric} {got.metric}", f"{got.train_s:.1f}",
                       f"{first_s / got.train_s:.2f}", f"{got.whole_s:.1f}"]
                print(" | ".join(row), flush=True)
                rows.append(row)
            described.append(f"{example.name} {' '.join(example.args)} (global batch "
                             f"{got.global_batch} {example.per_rank})")
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    if args.out is not None:
        write_table(args.out, columns=["example", "ranks", "final metric", "training time s",
                                       f"speed-up over {sizes[0]} rank(s)", "whole command s"],
                    rows=rows,
                    caption=f"dspark run --nproc N examples/EXAMPLE.py --out FRESH_DIR, one run each: "
                            f"{'; '.join(described)}. Training time is the example's own, from the first "
                            f"step to the last checkpoint, evaluations and saves included; the whole "
                            f"command includes start-up and exit; seconds.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
