"""The planner against the engine on models it was never tuned for: for each model of the validation
zoo (:mod:`dspark.models.plan_zoo`), fp32 and bf16, what ``dspark.plan`` predicts (one probe on one
CPU core) beside what ``dspark run`` measures, for every strategy on 1, 2 and 3 ranks: the tensor
peak, the process peak and the step. One JSON artifact; with ``--out DIR``, ``DIR/plan-validation.json``
and the table docs/figures.md renders (``DIR/table.json``, see [Note: table artifacts]).

    python -m dspark.bench.record --name DATE-MACHINE-plan-validation --anchor plan-validation \\
        --title "..." -- env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_validation.py
    .venv/bin/python benchmarks/plan_validation.py --table DIR/plan-validation.json
    .venv/bin/python benchmarks/plan_validation.py --replan DIR/plan-validation.json --out NEW

AdamW; each model's global batch (it divides by 1, 2 and 3). Measured per configuration, in a fresh
``dspark run`` launch: the process peak (``VmHWM`` of each rank's whole life: imports, model,
engine, steps), the median step of ``--steps`` timed steps after :data:`WARMUP_STEPS` warm-up steps
(the slowest rank's),
and then the tensor peak of one more step (:func:`dspark.planner.peak_memory.measure_peak_bytes`,
the lab's measure); the largest over ranks. On 1 rank every strategy is the same engine path, so it
is measured once, as replicate. 3 ranks share the 2 cores: their steps are not compared. The link is
measured first, on 2 ranks (:func:`dspark.planner.link_probe.measure_link`), and the plans are made
over it; the artifact keeps it under ``"link"``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dspark.models.plan_zoo import ZOO, build

STRATEGY_NAMES = ("replicate", "zero1", "zero2", "zero3")
PRECISIONS = ("fp32", "bf16")
RANKS = (1, 2, 3)
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-4)
WARMUP_STEPS = 3
"""Untimed steps before the timed ones. The plan predicts a steady step (its probe times rounds
after a warm-up of its own); in a fresh process the second to the fourth or fifth step of some
models still run slower than the ones after (the heap settling, pages faulted in), and a single
warm-up step timed that."""


def _rows(batch: Any) -> int:
    return int(batch["input_ids"].shape[0]) if isinstance(batch, dict) else int(batch[0].shape[0])


def _loss(engine: Any, batch: Any, loss_fn: Any) -> torch.Tensor:
    if loss_fn is None:
        return engine(**batch).loss
    inputs, targets = batch
    return loss_fn(engine(inputs), targets)


def worker(name: str, precision: str, strategy: str, steps: int, size: str) -> None:
    """One configuration on every rank of ``dspark run``; rank 0 prints one JSON line."""
    import dspark
    from dspark import comm
    from dspark.bench.measure.memory import peak_rss_bytes
    from dspark.engine.for_the_lab import measure_peak_bytes

    world = dspark.init()
    torch.set_num_threads(1)
    started = peak_rss_bytes()  # imports and the process group: before the model
    model, batch, loss_fn = build(name, size=size)
    engine = dspark.Engine(model, optimizer=OPTIMIZER, strategy=strategy, precision=precision)
    local = dspark.distribute_batch(batch, shard_dim=0)

    def step() -> None:
        engine.backward(_loss(engine, local, loss_fn))
        engine.step()

    for _ in range(WARMUP_STEPS):
        step()
    times = []
    for _ in range(steps):
        comm.barrier()
        start = time.perf_counter()
        step()
        comm.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    process = peak_rss_bytes()  # before the profiler below, which holds memory of its own
    peak = measure_peak_bytes(step, world.device)
    report = engine.memory_report()
    everyone = comm.all_gather_object({"step_ms": statistics.median(times), "peak_bytes": peak,
                                       "process_peak_bytes": process, "started_rss_bytes": started,
                                       "model_state_bytes": int(report["total_bytes"])})
    if world.rank == 0:
        print("RESULT " + json.dumps({key: max(e[key] for e in everyone) for key in everyone[0]}), flush=True)
    engine.close()
    dspark.shutdown()


def link_worker() -> None:
    """The link probe on every rank of ``dspark run``; rank 0 prints one JSON line."""
    import dataclasses

    import dspark
    from dspark.engine.for_the_lab import measure_link

    world = dspark.init()
    link = measure_link(world)
    if world.rank == 0:
        print("RESULT " + json.dumps(dataclasses.asdict(link)), flush=True)
    dspark.shutdown()


def link_from_dict(data: dict[str, Any]) -> Any:
    """The :class:`dspark.planner.Interconnect` ``dataclasses.asdict`` wrote."""
    from dspark.planner import Interconnect

    return Interconnect.from_dict(data)


def _run_ranks(ranks: int, *args: str) -> dict[str, Any]:
    dspark_cli = str(Path(sys.executable).with_name("dspark"))
    # --oversubscribe: 3 ranks share the 2 cores on purpose (their memory, not their step)
    out = subprocess.run([dspark_cli, "run", "--nproc", str(ranks), "--oversubscribe", __file__, *args],
                         capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{args} on {ranks}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def plan_for(name: str, precision: str, link: Any, size: str, ranks: tuple[int, ...] = RANKS) -> Any:
    """The plan of zoo model ``name`` on ``ranks`` (1, 2 and 3 by default), as a user would make it."""
    import dspark

    torch.set_num_threads(1)
    model, batch, loss_fn = build(name, size=size)
    return dspark.plan(model, batch, loss_fn, optimizer=OPTIMIZER, devices=sorted(set(ranks)), precision=precision,
                       global_batch=_rows(batch), interconnect=link)


def _row(name: str, precision: str, strategy: str, ranks: int, predicted: Any, got: dict[str, Any]) -> dict[str, Any]:
    return {"model": name, "precision": precision, "strategy": strategy, "ranks": ranks,
            "predicted_peak_bytes": predicted.peak_bytes, "measured_peak_bytes": got["peak_bytes"],
            "predicted_process_peak_bytes": predicted.process_peak_bytes,
            "measured_process_peak_bytes": got["process_peak_bytes"],
            "predicted_state_bytes": predicted.model_state_bytes, "measured_state_bytes": got["model_state_bytes"],
            "predicted_step_ms": predicted.step_ms, "measured_step_ms": got["step_ms"],
            "predicted_step_ms_low": predicted.step_ms_low, "predicted_step_ms_high": predicted.step_ms_high,
            "predicted_step_parts_ms": {"compute": predicted.compute_ms, "comm": predicted.comm_exposed_ms,
                                        "optimizer": predicted.optimizer_ms},
            "predicted_co_run_factors": {"compute": predicted.co_run_compute_factor,
                                         "optimizer": predicted.co_run_optimizer_factor},
            "step_compared": ranks < 3}


def validate(models: list[str], precisions: list[str], steps: int, size: str,
             measured: dict[str, Any] | None = None, strategies: tuple[str, ...] = STRATEGY_NAMES,
             ranks_wanted: tuple[int, ...] = RANKS) -> dict[str, Any]:
    """Plan and measure each configuration; with ``measured`` (an earlier artifact), plan only and
    take the measured values (and the link) from it (``--replan``: the current planner against kept
    measurements). ``strategies`` and ``ranks_wanted`` keep only those configurations (on 1 rank the
    one measured configuration is replicate's)."""
    kept = {(r["model"], r["precision"], r["strategy"], r["ranks"]): r for r in (measured or {}).get("rows", [])}
    link_data = measured["link"] if measured is not None else _run_ranks(2, "--link-worker")
    link = link_from_dict(link_data)
    print(f"link: {link}", flush=True)
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for name in models:
        for precision in precisions:
            try:
                plan = plan_for(name, precision, link, size, ranks_wanted)
            except Exception as error:  # one model's failure is kept, the zoo goes on
                failed.append({"model": name, "precision": precision, "strategy": "plan", "ranks": 0,
                               "error": repr(error)[-2000:]})
                print(f"FAILED plan of {name} {precision}: {error!r}", flush=True)
                continue
            print(plan, flush=True)
            for ranks in ranks_wanted:
                for strategy in (("replicate",) if ranks == 1 else strategies):
                    key = (name, precision, strategy, ranks)
                    if measured is not None:
                        if key not in kept:
                            continue
                        old = kept[key]
                        got = {"peak_bytes": old["measured_peak_bytes"], "step_ms": old["measured_step_ms"],
                               "process_peak_bytes": old["measured_process_peak_bytes"],
                               "model_state_bytes": old["measured_state_bytes"]}
                    else:
                        try:
                            got = _run_ranks(ranks, "--worker", name, precision, strategy,
                                             str(steps if ranks < 3 else 1), size)
                        except RuntimeError as error:  # kept as failed, never as a row
                            failed.append({"model": name, "precision": precision, "strategy": strategy,
                                           "ranks": ranks, "error": str(error)[-2000:]})
                            print(f"FAILED {key}: {error}", flush=True)
                            continue
                    rows.append(_row(name, precision, strategy, ranks, plan.row(strategy, ranks), got))
                    print(json.dumps(rows[-1]), flush=True)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if measured is not None:
        return {**measured, "rows": rows, "replanned": now}
    return {"command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_validation.py",
            "machine": f"{os.cpu_count()} CPU cores shared with other work; torch {torch.__version__}",
            "size": size, "steps": steps, "warmup_steps": WARMUP_STEPS,
            "link": link_data, "timestamp": now, "rows": rows, "failed": failed}


COLUMNS = ("model", "precision", "strategy", "ranks", "tensor peak predicted MB", "measured MB", "ratio",
           "process peak predicted MB", "measured MB", "ratio", "step predicted ms", "measured ms", "ratio")


def _ratio(predicted: float | None, measured: float) -> list[str]:
    if predicted is None or measured <= 0:
        return ["-", f"{measured / 1e6:.1f}", "-"]
    return [f"{predicted / 1e6:.1f}", f"{measured / 1e6:.1f}", f"{predicted / measured:.2f}"]


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    """The artifact's rows as formatted cells: predicted / measured tensor peak, process peak, step."""
    out = []
    for r in data["rows"]:
        step = ([f"{r['predicted_step_ms']:.0f}", f"{r['measured_step_ms']:.0f}",
                 f"{r['predicted_step_ms'] / r['measured_step_ms']:.2f}"] if r["step_compared"]
                else ["-", "-", "-"])
        out.append([r["model"], r["precision"], r["strategy"], str(r["ranks"]),
                    *_ratio(r["predicted_peak_bytes"], r["measured_peak_bytes"]),
                    *_ratio(r.get("predicted_process_peak_bytes"), r.get("measured_process_peak_bytes") or 0),
                    *step])
    return out


def summary(data: dict[str, Any]) -> str:
    """The range of each ratio over the artifact's rows."""
    def spread(pairs: list[tuple[float | None, float]], within: float) -> str:
        ratios = [p / m for p, m in pairs if p is not None and m]
        inside = sum(abs(r - 1) <= within for r in ratios)
        return (f"{min(ratios):.2f} to {max(ratios):.2f} over {len(ratios)} rows ({inside} within "
                f"{within:.0%})" if ratios else "none")
    rows = data["rows"]
    failed = "; failed (no row): " + ", ".join(
        f"{f['model']} {f['precision']} {f['strategy']} {f['ranks']} ranks"
        for f in data["failed"]) if data.get("failed") else ""
    tensor = spread([(r["predicted_peak_bytes"], r["measured_peak_bytes"]) for r in rows], 0.10)
    process = spread([(r.get("predicted_process_peak_bytes"), r.get("measured_process_peak_bytes") or 0)
                      for r in rows], 0.10)
    timed = [r for r in rows if r["step_compared"]]
    step = spread([(r["predicted_step_ms"], r["measured_step_ms"]) for r in timed], 0.15)
    ranged = [r for r in timed if r.get("predicted_step_ms_low") is not None]
    if ranged:  # artifacts kept before the interval was recorded have none
        inside = sum(r["predicted_step_ms_low"] <= r["measured_step_ms"] <= r["predicted_step_ms_high"]
                     for r in ranged)
        step += f", {inside} of {len(ranged)} inside the plan's interval"
    return f"tensor peak {tensor}; process peak {process}; step {step}{failed}"


def table(data: dict[str, Any]) -> str:
    """The artifact as a Markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(data)]
    return "\n".join(lines) + "\n\n" + summary(data)


def write_artifact(data: dict[str, Any], out: Path) -> None:
    """``out`` a ``.json`` file: the raw artifact; else a directory: ``plan-validation.json`` and
    ``table.json`` (what docs/figures.md renders) in it."""
    if out.suffix == ".json":
        out.write_text(json.dumps(data, indent=2) + "\n")
        return
    from dspark.bench.artifacts.table import write_table

    out.mkdir(parents=True, exist_ok=True)
    (out / "plan-validation.json").write_text(json.dumps(data, indent=2) + "\n")
    write_table(out, columns=COLUMNS, rows=table_rows(data),
                caption="Predicted by dspark.plan (one probe on one CPU core) against the engine run by "
                        "dspark run: AdamW, each zoo model's global batch; " + summary(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=5, metavar=("MODEL", "PRECISION", "STRATEGY", "STEPS", "SIZE"))
    parser.add_argument("--link-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--strategies", default=",".join(STRATEGY_NAMES),
                        help="only these strategies on 2 and 3 ranks (1 rank measures replicate)")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)),
                        help="these rank counts (default 1,2,3; more than the cores oversubscribe them)")
    parser.add_argument("--size", default="bench", help="the zoo's size: bench (default) or tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("plan-validation.json"),
                        help="a .json file, or a directory for plan-validation.json and table.json")
    parser.add_argument("--table", metavar="ARTIFACT", help="print the Markdown table of an artifact")
    parser.add_argument("--replan", metavar="ARTIFACT",
                        help="plan again with the current planner and compare with ARTIFACT's measurements")
    args = parser.parse_args()
    if args.link_worker:
        link_worker()
        return
    if args.worker:
        name, precision, strategy, steps, size = args.worker
        worker(name, precision, strategy, int(steps), size)
        return
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    measured = json.loads(Path(args.replan).read_text()) if args.replan else None
    data = validate(args.models.split(","), args.precisions.split(","), args.steps, args.size, measured,
                    tuple(args.strategies.split(",")), tuple(int(r) for r in args.ranks.split(",")))
    write_artifact(data, args.out)
    print(table(data))


if __name__ == "__main__":
    main()
