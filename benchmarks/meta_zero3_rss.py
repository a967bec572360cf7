"""Train a model whose training state does not fit in one rank's memory budget: built under
``torch.device("meta")`` and materialised by the engine one zero3 unit at a time, so no rank ever
holds it whole. Each rank reports its peak resident memory (VmHWM) next to the model's sizes.

    dspark run --nproc 2 benchmarks/meta_zero3_rss.py                      # meta build, zero3
    dspark run --nproc 2 benchmarks/meta_zero3_rss.py --build cpu          # whole model first
    dspark run --nproc 2 benchmarks/meta_zero3_rss.py --budget-gib 3.5     # enforce a budget

``--budget-gib`` caps each rank's private memory with ``RLIMIT_DATA`` once the process group is
up: an allocation beyond it fails, as it would on a device of that size. The default model (16 x
Linear(4096, 4096), 268M parameters, AdamW) needs 4.0 GiB of parameters, gradients and optimizer
state on one rank; zero3 on 2 ranks needs 2.0 GiB each, plus one unit gathered (64 MiB).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import resource
import time
from pathlib import Path

import torch
from torch import nn

import dspark
from dspark.bench.artifacts.table import write_table

GIB = 1024**3


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gib(value: object) -> str | None:
    """A figure as the JSON line prints it (rounded to 3 decimals), ``None`` (not reached) as is."""
    return None if value is None else str(value)


def _write_table(args: argparse.Namespace, results: list[dict], world_size: int) -> None:
    budget = "no budget" if args.budget_gib is None else f"a {args.budget_gib:g} GiB per-rank budget " \
                                                          f"enforced with RLIMIT_DATA"
    first = next((r for r in results if "num_params" in r), results[0])
    size = (f" {first['num_params'] / 1e6:.0f}M parameters ({first['params_gib']} GiB; training state "
            f"{first['training_state_gib']} GiB in one place, one unit {first['unit_gib']} GiB),"
            if "num_params" in first else "")
    write_table(args.out, columns=["rank", "trains?", "peak RSS GiB", "after building GiB",
                                   "state on this rank GiB", "build + steps s"],
                rows=[[r["rank"], f"yes, {args.steps} steps" if r["ok"] else f"no: {r['error']}",
                       _gib(r["peak_rss_gib"]), _gib(r.get("peak_after_build_gib")),
                       _gib(r.get("state_gib_this_rank")), _gib(r["seconds"])] for r in results],
                caption=f"{args.layers} x Linear({args.width}, {args.width}),{size} AdamW, "
                        f"{args.strategy}, built on {args.build}, {world_size} rank(s), {budget}; "
                        f"peak resident memory (VmHWM) per rank, GiB, one run.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--build", choices=["meta", "cpu"], default="meta")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="cap each rank's private memory (RLIMIT_DATA) at this many GiB")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json (rank 0)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    world = dspark.init(backend="gloo")
    if args.budget_gib is not None:
        limit = int(args.budget_gib * GIB)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    started = time.perf_counter()
    torch.manual_seed(0)
    result: dict[str, object] = {"rank": world.rank, "strategy": args.strategy, "build": args.build,
                                 "budget_gib": args.budget_gib}
    try:
        device = torch.device("meta") if args.build == "meta" else torch.device("cpu")
        with device:
            model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        num_params = sum(p.numel() for p in model.parameters())
        result.update(num_params=num_params, params_gib=round(4 * num_params / GIB, 3),
                      training_state_gib=round(16 * num_params / GIB, 3),
                      unit_gib=round(4 * (args.width + 1) * args.width / GIB, 3))
        engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                               strategy=args.strategy)
        del model
        result["peak_after_build_gib"] = round(_peak_bytes() / GIB, 3)
        for step in range(args.steps):
            x = torch.randn(8, args.width, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(dspark.distribute_batch(x, shard_dim=0)).square().mean())
            engine.step()
        result["state_gib_this_rank"] = round(int(engine.memory_report()["total_bytes"]) / GIB, 3)
        result["ok"] = True
        del engine
    except (RuntimeError, MemoryError) as exc:  # the budget refused an allocation
        result["ok"] = False
        result["error"] = str(exc).splitlines()[0][:160]
    result["peak_rss_gib"] = round(_peak_bytes() / GIB, 3)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result), flush=True)
    if args.out is not None:
        results = dspark.comm.all_gather_object(result)
        if world.is_main:
            _write_table(args, results, world.world_size)
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
