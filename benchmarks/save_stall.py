"""How long a checkpoint save stalls training, synchronous vs asynchronous.

Run on two ranks (one CPU core each)::

    dspark run --nproc 2 benchmarks/save_stall.py --params-m 8 --saves 5 --ckpt /tmp/stall-ckpt

Trains an MLP of about ``--params-m`` million parameters with AdamW under zero2 and saves every few
steps, first synchronously, then with ``async_save=True``. For each save it records how long the
``engine.save`` call blocked and how long the next step took; the *stall* of a save is the call plus
the next step's excess over the median step without saves (a background write competes with the
next step for the CPU and the disk). Rank 0 prints a table (milliseconds); ``--out DIR`` writes it
as ``DIR/table.json`` for docs/figures.md (see [Note: table artifacts]), ``--json`` as raw numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import dspark
from dspark.bench.artifacts.table import write_table
from dspark.checkpoint import wait_for_pending_save

WIDTH = 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True, help="directory the checkpoints go to")
    parser.add_argument("--params-m", type=float, default=8.0, help="model size, millions of parameters")
    parser.add_argument("--saves", type=int, default=5, help="saves measured per mode")
    parser.add_argument("--steps-between", type=int, default=4, help="steps between two saves")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    return parser.parse_args()


def step(engine: dspark.Engine, x: torch.Tensor) -> float:
    started = time.perf_counter()
    engine.backward(engine(x).square().mean())
    engine.step()
    return (time.perf_counter() - started) * 1e3


def measure(engine: dspark.Engine, x: torch.Tensor, ckpt: Path, *, async_save: bool, saves: int,
            steps_between: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"save_call_ms": [], "next_step_ms": [], "plain_step_ms": []}
    for i in range(saves):
        for _ in range(steps_between):
            out["plain_step_ms"].append(step(engine, x))
        started = time.perf_counter()
        engine.save(ckpt / f"save-{i % 2}", async_save=async_save)
        out["save_call_ms"].append((time.perf_counter() - started) * 1e3)
        out["next_step_ms"].append(step(engine, x))
    wait_for_pending_save()
    return out


def summary(raw: dict[str, list[float]], baseline_ms: float) -> dict[str, float]:
    stall = [call + max(0.0, nxt - baseline_ms) for call, nxt in zip(raw["save_call_ms"], raw["next_step_ms"],
                                                                      strict=True)]
    return {"save_call_ms": statistics.median(raw["save_call_ms"]),
            "next_step_ms": statistics.median(raw["next_step_ms"]),
            "stall_ms": statistics.median(stall), "stall_max_ms": max(stall)}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = dspark.init()
    layers = max(1, round(args.params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers)])
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), strategy="zero2")
    x = dspark.distribute_batch(torch.randn(args.batch, WIDTH), shard_dim=0)
    for _ in range(3):  # warm-up: allocations, optimizer state
        step(engine, x)
    results = {}
    plain: list[float] = []
    for mode in ("sync", "async"):
        raw = measure(engine, x, args.ckpt, async_save=mode == "async", saves=args.saves,
                      steps_between=args.steps_between)
        plain += raw["plain_step_ms"]
        results[mode] = raw
    baseline_ms = statistics.median(plain)
    table = {mode: summary(raw, baseline_ms) for mode, raw in results.items()}
    if world.is_main:
        num_params = sum(p.numel() for p in model.parameters())
        print(f"{num_params / 1e6:.1f}M parameters, zero2, {world.world_size} rank(s), "
              f"median step without a save {baseline_ms:.1f} ms")
        print(f"{'mode':<6} {'save call':>10} {'next step':>10} {'stall':>10} {'worst stall':>12}")
        for mode, row in table.items():
            print(f"{mode:<6} {row['save_call_ms']:>10.1f} {row['next_step_ms']:>10.1f} "
                  f"{row['stall_ms']:>10.1f} {row['stall_max_ms']:>12.1f}")
        if args.json is not None:
            args.json.write_text(json.dumps({"num_params": num_params, "world_size": world.world_size,
                                             "step_ms": baseline_ms, "modes": table}, indent=2) + "\n")
        if args.out is not None:
            write_table(args.out, columns=["mode", "save call ms", "next step ms", "stall ms",
                                           "worst stall ms"],
                        rows=[[mode, *(f"{row[k]:.1f}" for k in ("save_call_ms", "next_step_ms",
                                                                  "stall_ms", "stall_max_ms"))]
                              for mode, row in table.items()],
                        caption=f"{num_params / 1e6:.1f}M parameters, AdamW, zero2, {world.world_size} "
                                f"rank(s); medians of {args.saves} saves per mode; median step without a "
                                f"save {baseline_ms:.1f} ms.")
        shutil.rmtree(args.ckpt, ignore_errors=True)
    engine.close()
    dspark.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
