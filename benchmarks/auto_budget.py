"""``strategy="auto"`` against its budget, in fresh processes: for each zoo model
(:mod:`dspark.models.plan_zoo`, bench size) on 2 ranks, one launch with a roomy budget gives each
strategy's need (its predicted process peak plus the margin, ``dspark.planner.table.needed_bytes``,
or the peak auto's own probes reached where that is higher: ``Plan.probing_peak_bytes``);
then one launch per budget just above and just below each need: auto chooses (or refuses), the
engine trains ``--steps`` steps, and each rank's resident peak (``VmHWM`` of its whole life) is
measured. A budget is kept when no rank's peak exceeds it. With ``--out DIR``, ``DIR/table.json``
(see [Note: table artifacts]).

    python -m dspark.bench.record --name DATE-MACHINE-auto-budget --anchor auto-budget \\
        --title "..." -- env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/auto_budget.py
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

MODELS = ("mlp-wide", "embed-tied", "hf-gpt2")
SLACK = 0.02
"""Budgets at each need times ``1 +- SLACK``: just above and just below."""
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-4)


def worker(name: str, budget: int, steps: int) -> None:
    """Every rank of ``dspark run``: auto at ``budget``; rank 0 prints one JSON line."""
    import dspark
    from dspark import comm
    from dspark.bench.measure.memory import peak_rss_bytes
    from dspark.engine.for_the_lab import needed_bytes
    from dspark.models.plan_zoo import build

    dspark.init()
    torch.set_num_threads(1)
    model, batch, loss_fn = build(name, size="bench")
    local = dspark.distribute_batch(batch, shard_dim=0)
    try:
        engine = dspark.Engine(model, optimizer=OPTIMIZER, strategy="auto", memory_budget=budget,
                               sample_batch=local, loss_fn=loss_fn)
    except ValueError as exc:
        result: dict[str, Any] = {"refused": str(exc).split(";")[0]}
    else:
        for _ in range(steps):
            for part in engine.micro_batches(local):
                loss = engine(**part).loss if loss_fn is None else loss_fn(engine(part[0]), part[1])
                engine.backward(loss)
            engine.step()
        row = engine.plan.row(engine.strategy.name, dspark.get_world().world_size)
        result = {"strategy": engine.strategy.name, "micro_batch": engine.micro_batch,
                  "predicted_process_bytes": row.process_peak_bytes, "predicted_tensor_bytes": row.peak_bytes,
                  "probing_bytes": engine.plan.probing_peak_bytes,
                  "needs": {r.strategy: max(needed_bytes(r), engine.plan.probing_peak_bytes or 0)
                            for r in engine.plan.rows}}
        engine.close()
    peaks = comm.all_gather_object(peak_rss_bytes())
    if dspark.get_world().rank == 0:
        print("RESULT " + json.dumps({**result, "budget": budget, "measured_bytes": max(peaks)}), flush=True)
    dspark.shutdown()


def _launch(name: str, budget: int, steps: int) -> dict[str, Any]:
    dspark_cli = str(Path(sys.executable).with_name("dspark"))
    out = subprocess.run([dspark_cli, "run", "--nproc", "2", __file__, "--worker", name, str(budget), str(steps)],
                         capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{name} at {budget}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


COLUMNS = ("model", "budget MB", "against", "choice", "predicted process MB", "predicted tensor MB",
           "auto's probes MB", "measured process MB", "within budget")


def run(models: list[str], steps: int) -> list[list[Any]]:
    rows = []
    for name in models:
        needs = _launch(name, 1 << 40, 1)["needs"]
        print(name, {k: round(v / 1e6, 1) for k, v in needs.items()}, flush=True)
        for strategy, need in sorted(needs.items(), key=lambda item: item[1]):
            for side, budget in (("above", int(need * (1 + SLACK))), ("below", int(need * (1 - SLACK)))):
                got = _launch(name, budget, steps)
                choice = (f"{got['strategy']} x{got['micro_batch']}" if "strategy" in got else "refused")
                kept = "refused" in got or got["measured_bytes"] <= budget
                rows.append([name, f"{budget / 1e6:.1f}", f"{side} {strategy}'s need", choice,
                             "-" if "refused" in got else f"{got['predicted_process_bytes'] / 1e6:.1f}",
                             "-" if "refused" in got else f"{got['predicted_tensor_bytes'] / 1e6:.1f}",
                             "-" if not got.get("probing_bytes") else f"{got['probing_bytes'] / 1e6:.1f}",
                             f"{got['measured_bytes'] / 1e6:.1f}", "yes" if kept else "NO"])
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "BUDGET", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write DIR/table.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))
        return
    rows = run(args.models.split(","), args.steps)
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, columns=COLUMNS, rows=rows,
                    caption=f"strategy='auto' on 2 CPU ranks, AdamW, {args.steps} steps; a rank's process "
                            "peak is its VmHWM over its whole life (the largest over ranks); a refused "
                            "budget built no engine")
    for row in rows:
        print(" | ".join(map(str, row)))


if __name__ == "__main__":
    main()
