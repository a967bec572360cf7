"""DSpark's engine on one core under each ``DSPARK_CPU_MALLOC`` choice (see :mod:`dspark.cpu_malloc`):
glibc's own moving thresholds, ``tuned`` (the default), ``heap`` and ``lean``. Each choice runs in a fresh
process (malloc's state is per process), the choices interleaved round after round; printed per
choice: the median step over all rounds, the page faults of a median step and the peak resident
memory. ``--out DIR`` writes that table as ``DIR/table.json`` for docs/figures.md (see [Note: table
artifacts]); the parent process writes it, from its children's figures.

    OMP_NUM_THREADS=1 python benchmarks/cpu_malloc.py --workload gpt2-cpu --batch 16 --rounds 2
    OMP_NUM_THREADS=1 python benchmarks/cpu_malloc.py --workload gpt2-124m --batch 1 --precision fp32 --steps 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dspark.bench.measure.rounds import round_order

CHOICES = ("default", "tuned", "heap", "lean")


def child(args: argparse.Namespace) -> None:
    import torch

    import dspark
    from dspark import cpu_malloc
    from dspark.models import get_workload

    torch.set_num_threads(1)
    dspark.init()
    workload = get_workload(args.workload)
    engine = dspark.Engine(workload.build_model(seed=0), precision=args.precision,
                           optimizer=functools.partial(torch.optim.AdamW, lr=1e-4))
    inputs, targets = workload.make_batch(args.batch, seed=0)
    ms, faults = [], []
    for step in range(args.warmup + args.steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        engine.backward(workload.loss(engine(inputs), targets))
        engine.step()
        if step >= args.warmup:
            ms.append((time.perf_counter() - start) * 1e3)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    state = cpu_malloc.current()
    print(json.dumps({"malloc": state.describe() if state else "", "ms": ms, "faults": faults,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    engine.close()
    dspark.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-cpu")
    parser.add_argument("--batch", type=int, default=16, help="samples per step")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per choice, interleaved")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    parser.add_argument("--choices", default=",".join(CHOICES), help="comma-separated, of " + ", ".join(CHOICES))
    parser.add_argument("--child", choices=CHOICES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    argv = ["--workload", args.workload, "--batch", str(args.batch), "--precision", args.precision,
            "--warmup", str(args.warmup), "--steps", str(args.steps)]
    choices = args.choices.split(",")
    if unknown := sorted(set(choices) - set(CHOICES)):
        parser.error(f"--choices {args.choices!r}: unknown {unknown}; the choices are {', '.join(CHOICES)}")
    runs: dict[str, list[dict[str, object]]] = {c: [] for c in choices}
    for round_index in range(args.rounds):
        for choice in round_order(choices, round_index):
            env = {**os.environ, "DSPARK_CPU_MALLOC": choice, "OMP_NUM_THREADS": "1"}
            # stderr passes through: a child that fails shows its error, not only its exit status
            done = subprocess.run([sys.executable, __file__, *argv, "--child", choice], env=env,
                                  stdout=subprocess.PIPE, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[choice].append(run)
            print(f"round {round_index + 1}/{args.rounds} {choice}: median "
                  f"{statistics.median(run['ms']):.1f} ms, {statistics.median(run['faults']):.0f} "
                  f"faults/step, peak RSS {run['rss_mb']:.0f} MB", flush=True)
    print(f"\n{args.workload}, batch {args.batch}, {args.precision}, {args.rounds} x {args.steps} "
          "steps per choice")
    print(f"{'DSPARK_CPU_MALLOC':<18} {'malloc':<36} {'step ms':>8} {'faults/step':>12} {'peak RSS MB':>12}")
    rows = []
    for choice, choice_runs in runs.items():
        steps = [ms for run in choice_runs for ms in run["ms"]]  # type: ignore[attr-defined]
        faults = [f for run in choice_runs for f in run["faults"]]  # type: ignore[attr-defined]
        rss = max(float(run["rss_mb"]) for run in choice_runs)  # type: ignore[arg-type]
        row = [choice, str(choice_runs[0]["malloc"]), f"{statistics.median(steps):.1f}",
               f"{statistics.median(faults):.0f}", f"{rss:.0f}"]
        rows.append(row)
        print(f"{row[0]:<18} {row[1]:<36} {row[2]:>8} {row[3]:>12} {row[4]:>12}")
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, columns=["DSPARK_CPU_MALLOC", "malloc", "step ms", "faults/step",
                                       "peak RSS MB"], rows=rows,
                    caption=f"{args.workload}, batch {args.batch}, {args.precision}, AdamW, the engine on "
                            f"one rank and one thread. Each choice in a fresh process per round, the "
                            f"choices interleaved, {args.rounds} round(s) of {args.warmup} warm-up and "
                            f"{args.steps} timed steps: step ms and minor page faults per step are "
                            f"medians over every timed step of a choice, peak RSS (MB = 2^20 bytes) the "
                            f"largest of its processes.")


if __name__ == "__main__":
    main()
