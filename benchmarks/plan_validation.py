"""The planner against the engine: for each model, what ``dspark.plan`` predicts (one probe on one
CPU core) beside what ``dspark run`` measures, per strategy on 1 and 2 ranks (and memory on 4),
written to one JSON artifact; with ``--out DIR``, ``DIR/plan-validation.json`` and the table
docs/figures.md renders (``DIR/table.json``, see [Note: table artifacts]).

    python -m dspark.bench.record --name DATE-MACHINE-plan-validation --anchor plan-validation \
        --title "..." -- env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_validation.py
    .venv/bin/python benchmarks/plan_validation.py --table DIR/plan-validation.json

Models: the two CPU presets (gpt2-cpu, resnet50-cpu) and a HuggingFace GPT2LMHeadModel built
from a config (4 layers x 256, vocabulary 2048, 128 tokens). bf16 autocast, AdamW, the
workloads' global batches (gpt2-cpu 32, resnet50-cpu 128, HF 16). Measured per configuration: the
median step of ``--steps`` timed steps after one warm-up (the slowest rank's), and the tensor peak
of one more step (:func:`dspark.planner.peak_memory.measure_peak_bytes`, the lab's measure), the
largest over ranks. On 1 rank every strategy is the same engine path (nothing to shard or
communicate), so 1 rank is measured once, as replicate. 4 ranks on a 2-core machine share cores:
only their memory is compared. The link is measured first, on 2 ranks through the same transport
(:func:`dspark.planner.link_probe.measure_link`: all-reduce, reduce-scatter and all-gather apart), and
the plan is made over it; the artifact keeps it under ``"link"``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODELS = ("gpt2-cpu", "resnet50-cpu", "hf-gpt2")
STRATEGY_NAMES = ("replicate", "zero1", "zero2", "zero3")
PRECISION = "bf16"


def build(name: str) -> tuple[torch.nn.Module, Any, Any, int]:
    """``(model, global batch, loss_fn or None, global batch size)``, the same on every call."""
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging

        logging.set_verbosity_error()
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(config)
        tokens = torch.randint(0, 2048, (16, 128), generator=torch.Generator().manual_seed(0))
        return model, {"input_ids": tokens, "labels": tokens}, None, 16
    from dspark.models import get_workload

    wl = get_workload(name)
    return (wl.build_model(seed=0), wl.make_batch(wl.default_global_batch, seed=0), wl.loss,
            wl.default_global_batch)


def _loss(engine: Any, batch: Any, loss_fn: Any) -> torch.Tensor:
    if loss_fn is None:
        return engine(**batch).loss
    inputs, targets = batch
    return loss_fn(engine(inputs), targets)


def worker(name: str, strategy: str, steps: int) -> None:
    """One configuration on every rank of ``dspark run``; rank 0 prints one JSON line."""
    import functools

    import dspark
    from dspark import comm
    from dspark.planner.peak_memory import measure_peak_bytes

    world = dspark.init()
    model, batch, loss_fn, _ = build(name)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                           strategy=strategy, precision=PRECISION)
    local = dspark.distribute_batch(batch, shard_dim=0)

    def step() -> None:
        engine.backward(_loss(engine, local, loss_fn))
        engine.step()

    step()  # warm-up
    times = []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        step()
        comm.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    peak = measure_peak_bytes(step, world.device)
    report = engine.memory_report()
    everyone = comm.all_gather_object({"step_ms": statistics.median(times), "peak_bytes": peak,
                                       "model_state_bytes": int(report["total_bytes"])})
    if world.rank == 0:
        print("RESULT " + json.dumps({"step_ms": max(e["step_ms"] for e in everyone),
                                      "peak_bytes": max(e["peak_bytes"] for e in everyone),
                                      "model_state_bytes": max(e["model_state_bytes"] for e in everyone)}),
              flush=True)
    engine.close()
    dspark.shutdown()


def link_worker() -> None:
    """The link probe on every rank of ``dspark run``; rank 0 prints one JSON line."""
    import dataclasses

    import dspark
    from dspark.planner.link_probe import measure_link

    world = dspark.init()
    link = measure_link(world)
    if world.rank == 0:
        print("RESULT " + json.dumps(dataclasses.asdict(link)), flush=True)
    dspark.shutdown()


def link_from_dict(data: dict[str, Any]) -> Any:
    """The :class:`dspark.planner.Interconnect` ``dataclasses.asdict`` wrote."""
    from dspark.planner.interconnect import Interconnect, LinkCost

    return Interconnect(**{**data, "inter_node": None,
                           "per_collective": tuple((name, LinkCost(**cost)) for name, cost in data["per_collective"])})


def _run_ranks(ranks: int, *args: str) -> dict[str, Any]:
    dspark_cli = str(Path(sys.executable).with_name("dspark"))
    # --oversubscribe: 4 ranks share the 2 cores on purpose (memory only; see above)
    out = subprocess.run([dspark_cli, "run", "--nproc", str(ranks), "--oversubscribe", __file__, *args],
                         capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{args} on {ranks}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def measure(name: str, strategy: str, ranks: int, steps: int) -> dict[str, float]:
    return _run_ranks(ranks, "--worker", name, strategy, str(steps))


def validate(models: list[str], steps: int, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plan and measure each configuration; with ``measured`` (an earlier artifact), plan only and
    take the measured values from it (``--replan``: the current model against kept measurements)."""
    import dspark

    kept = {(r["model"], r["strategy"], r["ranks"]): r for r in (measured or {}).get("rows", [])}
    rows = []
    link_data = _run_ranks(2, "--link-worker")
    link = link_from_dict(link_data)
    print(f"link: {link}", flush=True)
    for name in models:
        model, batch, loss_fn, global_batch = build(name)
        torch.set_num_threads(1)
        plan = dspark.plan(model, batch, loss_fn, devices=[1, 2, 4], precision=PRECISION,
                           global_batch=global_batch, interconnect=link)
        print(plan, flush=True)
        for ranks in (1, 2, 4):
            for strategy in (("replicate",) if ranks == 1 else STRATEGY_NAMES):
                row = plan.row(strategy, ranks)
                if measured is not None:
                    if (name, strategy, ranks) not in kept:
                        continue
                    old = kept[(name, strategy, ranks)]
                    got = {"peak_bytes": old["measured_peak_bytes"], "step_ms": old["measured_step_ms"],
                           "model_state_bytes": old["measured_state_bytes"]}
                else:
                    got = measure(name, strategy, ranks, steps if ranks < 4 else 1)
                rows.append({"model": name, "strategy": strategy, "ranks": ranks,
                             "predicted_peak_bytes": row.peak_bytes, "measured_peak_bytes": got["peak_bytes"],
                             "predicted_state_bytes": row.model_state_bytes,
                             "measured_state_bytes": got["model_state_bytes"],
                             "predicted_step_ms": row.step_ms, "measured_step_ms": got["step_ms"],
                             "predicted_step_parts_ms": {"compute": row.compute_ms, "comm": row.comm_exposed_ms,
                                                         "optimizer": row.optimizer_ms},
                             "step_compared": ranks < 4})
                print(json.dumps(rows[-1]), flush=True)
    if measured is not None:
        return {**measured, "rows": rows, "link": link_data, "replanned": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {"command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_validation.py",
            "machine": f"{os.cpu_count()} CPU cores shared with other work; torch {torch.__version__}",
            "precision": PRECISION, "steps": steps, "link": link_data,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}


COLUMNS = ("model", "strategy", "ranks", "peak predicted MB", "peak measured MB", "ratio",
           "step predicted ms", "step measured ms", "ratio")


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    """The artifact's rows as formatted cells: predicted / measured for peak and step."""
    rows = []
    for r in data["rows"]:
        step = ([f"{r['predicted_step_ms']:.0f}", f"{r['measured_step_ms']:.0f}",
                 f"{r['predicted_step_ms'] / r['measured_step_ms']:.2f}"] if r["step_compared"]
                else ["-", "-", "-"])
        rows.append([r["model"], r["strategy"], str(r["ranks"]), f"{r['predicted_peak_bytes'] / 1e6:.1f}",
                     f"{r['measured_peak_bytes'] / 1e6:.1f}",
                     f"{r['predicted_peak_bytes'] / r['measured_peak_bytes']:.2f}", *step])
    return rows


def table(data: dict[str, Any]) -> str:
    """The artifact as a Markdown table: predicted / measured for peak and step."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(data)]
    return "\n".join(lines)


def write_artifact(data: dict[str, Any], out: Path) -> None:
    """``out`` a ``.json`` file: the raw artifact; else a directory: ``plan-validation.json`` and
    ``table.json`` (what docs/figures.md renders) in it."""
    if out.suffix == ".json":
        out.write_text(json.dumps(data, indent=2) + "\n")
        return
    from dspark.bench.artifacts.table import write_table

    out.mkdir(parents=True, exist_ok=True)
    (out / "plan-validation.json").write_text(json.dumps(data, indent=2) + "\n")
    write_table(out, columns=COLUMNS, rows=table_rows(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "STRATEGY", "STEPS"))
    parser.add_argument("--link-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("plan-validation.json"),
                        help="a .json file, or a directory for plan-validation.json and table.json")
    parser.add_argument("--table", metavar="ARTIFACT", help="print the Markdown table of an artifact")
    parser.add_argument("--replan", metavar="ARTIFACT",
                        help="plan again with the current model and compare with ARTIFACT's measurements")
    args = parser.parse_args()
    if args.link_worker:
        link_worker()
        return
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    measured = json.loads(Path(args.replan).read_text()) if args.replan else None
    data = validate(args.models.split(","), args.steps, measured)
    write_artifact(data, args.out)
    print(table(data))


if __name__ == "__main__":
    main()
