"""A long run's resident memory, step by step, with the engine's heap guard on and off (see
[Note: the heap ratchet] in dspark.cpu_malloc): for each zoo model and strategy (:mod:`dspark.models.plan_zoo`,
AdamW, 2 ranks), a fresh ``dspark run`` per setting of ``DSPARK_HEAP_GUARD``, the two settings one
after the other.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/heap_ratchet.py --steps 30 --out DIR
    python -m dspark.bench.record --name DATE-MACHINE-heap-ratchet --anchor heap-ratchet --title "..." \\
        -- env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/heap_ratchet.py --steps 30

Per run, the largest over its ranks: the resident memory (``VmRSS``) after step 3 (the guard
takes its baseline after step 1) and after the last step, the growth per step between them, the peak (``VmHWM``,
the whole process's life), the median and the mean step (a trim's page faults show in the mean, not
the median), and how many times the guard trimmed. ``--out DIR`` writes ``DIR/table.json`` for
docs/figures.md (see [Note: table artifacts]).

``--vary-length`` cuts each step's batch along its sequence dimension (dim 1 of every tensor of two
or more dimensions) to a share of its length from :data:`LENGTH_SHARES` in turn: a workload whose
transients change size every step, where the guard must tell a longer step that needs its memory
from a ratchet rather than trim at every long step (it keeps a level it trimmed at on a heap that
had not grown: [Note: a level trimmed before] in dspark.engine.heap_guard).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

RUNS = ("embed-tied:zero3", "embed-untied:zero3", "hf-gpt2:zero3", "hf-gpt2:replicate", "embed-tied:replicate")
COLUMNS = ("model", "strategy", "guard", "steps", "RSS after step 3 MB", "RSS after last step MB",
           "growth MB/step", "peak RSS MB", "step ms median", "step ms mean", "trims")
SETTLED_STEP = 3
LENGTH_SHARES = (0.125, 1.0, 0.25, 0.75, 0.5, 1.0)
"""``--vary-length``: each step's share of the batch's sequence length, in turn."""


def _cut(batch: Any, share: float) -> Any:
    """``batch`` with every tensor of two or more dimensions cut to ``share`` of its dim 1."""
    if isinstance(batch, torch.Tensor):
        return batch[:, :max(1, round(batch.shape[1] * share))] if batch.dim() >= 2 else batch
    if isinstance(batch, dict):
        return {k: _cut(v, share) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cut(v, share) for v in batch)
    return batch


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


class _TrimCounter(logging.Handler):
    """Counts the heap guard's trims on this rank (one record each)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def worker(name: str, strategy: str, steps: int, guard: str, size: str, vary: bool = False) -> None:
    """One run on every rank of ``dspark run``; rank 0 prints one JSON line."""
    os.environ["DSPARK_HEAP_GUARD"] = guard  # read when the engine is built
    import dspark
    from dspark import comm
    from dspark.models.plan_zoo import build

    world = dspark.init()
    torch.set_num_threads(1)
    model, batch, loss_fn = build(name, size=size)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), strategy=strategy)
    local = dspark.distribute_batch(batch, shard_dim=0)
    trims = _TrimCounter()
    guard_log = logging.getLogger("dspark.engine.heap_guard")
    guard_log.setLevel(logging.INFO)  # the first trim warns, the later ones are told at INFO
    guard_log.addHandler(trims)
    rss_mb, step_ms = [], []
    for step in range(steps):
        part = _cut(local, LENGTH_SHARES[step % len(LENGTH_SHARES)]) if vary else local
        comm.barrier()
        start = time.perf_counter()
        loss = engine(**part).loss if loss_fn is None else loss_fn(engine(part[0]), part[1])
        engine.backward(loss)
        engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        rss_mb.append(_status_mb("VmRSS"))
    mine = {"rss_mb": rss_mb, "step_ms": step_ms, "peak_mb": _status_mb("VmHWM"), "trims": trims.count}
    everyone = comm.all_gather_object(mine)
    if world.rank == 0:
        result = {"rss_mb": [max(e["rss_mb"][i] for e in everyone) for i in range(steps)],
                  "step_ms": [max(e["step_ms"][i] for e in everyone) for i in range(steps)],
                  "peak_mb": max(e["peak_mb"] for e in everyone), "trims": max(e["trims"] for e in everyone)}
        print("RESULT " + json.dumps(result), flush=True)
    guard_log.removeHandler(trims)
    engine.close()
    dspark.shutdown()


def _launch(*args: str) -> dict[str, Any]:
    dspark_cli = str(Path(sys.executable).with_name("dspark"))
    out = subprocess.run([dspark_cli, "run", "--nproc", "2", __file__, "--worker", *args],
                         capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{args}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def row(name: str, strategy: str, guard: str, got: dict[str, Any]) -> list[Any]:
    rss, steps = got["rss_mb"], len(got["rss_mb"])
    settled = rss[SETTLED_STEP - 1]
    growth = (rss[-1] - settled) / (steps - SETTLED_STEP) if steps > SETTLED_STEP else 0.0
    return [name, strategy, guard, steps, round(settled), round(rss[-1]), round(growth, 1), round(got["peak_mb"]),
            round(statistics.median(got["step_ms"][SETTLED_STEP:] or got["step_ms"]), 1),
            round(statistics.fmean(got["step_ms"][SETTLED_STEP:] or got["step_ms"]), 1),
            "-" if guard == "off" else got["trims"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=6, metavar=("MODEL", "STRATEGY", "STEPS", "GUARD", "SIZE", "VARY"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--vary-length", action="store_true",
                        help="cut each step's batch to a changing share of its sequence length (token models)")
    parser.add_argument("--runs", default=",".join(RUNS), help="MODEL:STRATEGY pairs, comma-separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", default="bench", help="the zoo's size: bench (default) or tiny")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    args = parser.parse_args()
    if args.worker:
        name, strategy, steps, guard, size, vary = args.worker
        worker(name, strategy, int(steps), guard, size, vary == "1")
        return
    rows = []
    for pair in args.runs.split(","):
        name, strategy = pair.split(":")
        for guard in ("off", "on"):
            got = _launch(name, strategy, str(args.steps), guard, args.size, "1" if args.vary_length else "0")
            rows.append(row(name, strategy, guard, got))
            print(" | ".join(map(str, rows[-1])), flush=True)
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, columns=COLUMNS, rows=rows,
                    caption=f"2 ranks, AdamW, zoo models at their {args.size} size, {args.steps} steps each, a fresh "
                            "`dspark run` per row; per row the largest over its ranks: resident memory after step "
                            f"{SETTLED_STEP} and after the last step (MB = 2^20 bytes), growth per step between "
                            "them, peak resident memory, step times after step 3, and the heap guard's trims "
                            "(the most on one rank)"
                            + ("; each step's batch cut to a share of its sequence length, in turn "
                               f"{', '.join(map(str, LENGTH_SHARES))}" if args.vary_length else ""))


if __name__ == "__main__":
    main()
