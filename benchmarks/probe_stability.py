"""How steady the planner's probe is ([Note: steady steps] in ``dspark/planner/probe_timing.py``): the
same probe of each model run ``--repeats`` times in a row, then once more while a CPU hog (one
busy-looping process per core) shares the machine. Per run: the rounds the probe timed, whether it
called them steady and their spread, any fit it refused, and the step it then predicts for one rank
and for two (replicate, over the ``loopback-gloo`` profile, so that only the probe moves), each with
its interval. On a quiet machine the repeats should agree within their intervals and be steady;
under the hog the probe should say it is not steady rather than return a confident wrong number.

    python -m dspark.bench.record --name DATE-MACHINE-probe-stability --anchor probe-stability \\
        --title "..." -- env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_stability.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

MODELS = ("mlp-deep", "conv-bn", "transformer-long")
HOG = "while True: pass"


@contextlib.contextmanager
def cpu_hog() -> Iterator[None]:
    """One busy-looping process per core while inside."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _range(row: Any) -> str:
    return "-" if row.step_ms_low is None else f"{row.step_ms_low:.0f}-{row.step_ms_high:.0f}"


def probe_once(name: str, size: str = "bench") -> list[Any]:
    import dspark
    from dspark.models.plan_zoo import build

    torch.set_num_threads(1)
    model, batch, loss_fn = build(name, size=size)
    rows = int(batch["input_ids"].shape[0]) if isinstance(batch, dict) else int(batch[0].shape[0])
    plan = dspark.plan(model, batch, loss_fn, devices=[1, 2], strategies=["replicate"], global_batch=rows,
                       interconnect="loopback-gloo", process_baseline_bytes=1)
    probe, one, two = plan.probe, plan.row("replicate", 1), plan.row("replicate", 2)
    return [probe.timing_rounds, "yes" if probe.steady else "NO", f"{probe.step_spread:.0%}",
            ", ".join(probe.refused_fits) or "-", f"{one.step_ms:.0f}", _range(one), f"{two.step_ms:.0f}",
            _range(two), f"{one.step_ms / two.step_ms:.2f}x"]


COLUMNS = ("model", "run", "rounds", "steady", "spread", "refused fits", "1 rank step ms", "range",
           "2 ranks step ms", "range", "speedup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hog", action="store_true", help="skip the run under a CPU hog")
    parser.add_argument("--size", default="bench", choices=("bench", "tiny"),
                        help="the zoo models' size (tiny: a smoke run)")
    parser.add_argument("--out", type=Path, help="write DIR/table.json")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        for k in range(args.repeats):
            rows.append([name, f"{k + 1}", *probe_once(name, args.size)])
            print(" | ".join(map(str, rows[-1])), flush=True)
        if not args.no_hog:
            with cpu_hog():
                rows.append([name, "CPU hog", *probe_once(name, args.size)])
            print(" | ".join(map(str, rows[-1])), flush=True)
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, columns=COLUMNS, rows=rows,
                    caption="The same dspark.plan probe (zoo models at their bench size, one CPU core) run "
                            "in a row, then under a CPU hog (a busy loop per core); the step ranges are "
                            "the rows' intervals from the probe's own rounds")


if __name__ == "__main__":
    main()
