"""DSpark's asynchronous save against PyTorch DCP's own ``async_save``: which stalls training less.

Run on two ranks (one CPU core each)::

    dspark run --nproc 2 benchmarks/async_save_vs_dcp.py --params-m 8 --saves 5 --ckpt /tmp/stall-ckpt

The model, optimizer and stall figure are those of ``benchmarks/save_stall.py`` (the stall of a save
is the call plus the next step's excess over the median step without saves). The two modes
alternate save by save (A B A B: the machine may be shared):

* ``dspark``: ``engine.save(path, async_save=True)``: staged on the CPU in the caller's thread,
  then written by DSpark's background thread (``dspark/checkpoint/background.py``), which also
  writes the JSON files and the manifest and publishes the directory atomically;
* ``dcp``: ``torch.distributed.checkpoint.async_save(engine.sharded_state_dict(), ...)`` on a gloo
  group of its own: the DCP write alone (no JSON, manifest or publication), so it is the lower bound
  of what a save built on it could stall.

Each save is waited for before the next one. Rank 0 prints the medians (milliseconds); ``--out DIR``
writes them as ``DIR/table.json`` for docs/figures.md (see [Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dspark
from dspark.bench.artifacts.table import write_table
from dspark.bench.measure.rounds import round_order
from dspark.checkpoint import wait_for_pending_save

WIDTH = 1024
MODE_NAMES = {"dspark": "DSpark `engine.save(async_save=True)`", "dcp": "DCP `async_save` (the write alone)"}


def step(engine: dspark.Engine, x: torch.Tensor) -> float:
    started = time.perf_counter()
    engine.backward(engine(x).square().mean())
    engine.step()
    return (time.perf_counter() - started) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--params-m", type=float, default=8.0)
    parser.add_argument("--saves", type=int, default=5, help="saves measured per mode")
    parser.add_argument("--steps-between", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = dspark.init()
    layers = max(1, round(args.params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers)])
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                           strategy="zero2")
    x = dspark.distribute_batch(torch.randn(args.batch, WIDTH), shard_dim=0)
    dcp_group = dspark.comm.new_group(backend="gloo").pg
    for _ in range(3):
        step(engine, x)
    plain: list[float] = []
    calls: dict[str, list[float]] = {"dspark": [], "dcp": []}
    nexts: dict[str, list[float]] = {"dspark": [], "dcp": []}
    for i in range(args.saves):
        for mode in round_order(["dspark", "dcp"], i):
            for _ in range(args.steps_between):
                plain.append(step(engine, x))
            path = args.ckpt / f"{mode}-{i % 2}"
            started = time.perf_counter()
            if mode == "dspark":
                engine.save(path, async_save=True)
            else:
                future = dcp.async_save(engine.sharded_state_dict(), checkpoint_id=str(path),
                                        process_group=dcp_group)
            calls[mode].append((time.perf_counter() - started) * 1e3)
            nexts[mode].append(step(engine, x))
            if mode == "dspark":
                wait_for_pending_save()
            else:
                future.result()
    baseline = statistics.median(plain)
    if world.is_main:
        print(f"median step without a save {baseline:.1f} ms, {world.world_size} rank(s)")
        print(f"{'mode':<7} {'save call':>10} {'next step':>10} {'stall':>10}")
        rows = []
        for mode in round_order(["dspark", "dcp"], i):
            stall = [c + max(0.0, n - baseline) for c, n in zip(calls[mode], nexts[mode], strict=True)]
            rows.append([mode, *(f"{statistics.median(v):.1f}" for v in (calls[mode], nexts[mode], stall))])
            print(f"{mode:<7} {rows[-1][1]:>10} {rows[-1][2]:>10} {rows[-1][3]:>10}")
        if args.out is not None:
            num_params = sum(p.numel() for p in model.parameters())
            write_table(args.out, columns=["mode", "save call ms", "next step ms", "stall ms"],
                        rows=[[MODE_NAMES[r[0]], *r[1:]] for r in rows],
                        caption=f"{num_params / 1e6:.1f}M parameters, AdamW, zero2, {world.world_size} "
                                f"rank(s); medians of {args.saves} saves per mode, the modes alternating; "
                                f"median step without a save {baseline:.1f} ms.")
        shutil.rmtree(args.ckpt, ignore_errors=True)
    engine.close()
    dspark.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
