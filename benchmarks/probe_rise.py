"""What ``strategy="auto"``'s probe adds to its process, predicted before it runs against measured
(see [Note: the probe inside the budget] in dspark.planner.probe_budget): for each model, a fresh
process reads its resident memory, probes the model as auto does on rank 0 (``dspark.plan`` at the
largest micro-batch given) and reads its peak resident memory (``VmHWM``) after. A prediction holds
when it is at least the measured rise: auto lets its probe train only micro-batches whose predicted
rise fits the room its budget leaves.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_rise.py --out DIR
    python -m dspark.bench.record --name DATE-MACHINE-probe-rise --anchor probe-rise --title "..." \\
        -- env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probe_rise.py

``--out DIR`` writes ``DIR/table.json`` (see [Note: table artifacts]). Memory, not time: the
machine's load does not change it.
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

CASES = ("mlp-wide:tiny:6", "embed-tied:tiny:3", "hf-gpt2:tiny:2", "conv-bn:bench:16", "mlp-wide:bench:24",
         "embed-tied:bench:6", "transformer-long:bench:4", "hf-gpt2:bench:6", "gpt-logits:bench:2",
         "gpt-logits:bench:8")
"""MODEL:SIZE:ROWS, ROWS the probe's larger batch. ``gpt-logits`` is examples/train_gpt.py's model at
512 tokens over a vocabulary of 8192 (its logits dominate: the case auto splits in its test)."""
COLUMNS = ("model", "size", "probe rows", "state MB", "activations MB", "predicted rise MB", "measured rise MB",
           "measured / predicted", "bound holds")
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-4)


def _model(name: str, size: str) -> tuple[Any, Any, Any]:
    if name == "gpt-logits":
        from dspark.models import GPT, GPTConfig, synthetic_tokens

        model = GPT(GPTConfig(vocab_size=8192, context_len=512, num_layers=2, num_heads=4, width=128))

        def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

        return model, synthetic_tokens(8, seq_len=512, vocab_size=8192, seed=0), token_loss
    from dspark.models.plan_zoo import build

    return build(name, size=size)


def worker(name: str, size: str, rows: int) -> None:
    """One case in this fresh process: one JSON line."""
    import dspark
    from dspark.bench.measure.memory import peak_rss_bytes, reset_peak_rss
    from dspark.cpu_malloc import release_freed, tune_for_training
    from dspark.engine.for_the_lab import probe_need, process_bytes

    tune_for_training()
    dspark.init()
    torch.set_num_threads(1)
    model, batch, loss_fn = _model(name, size)
    cpu = torch.device("cpu")
    need = probe_need(model, batch, loss_fn=loss_fn, optimizer=OPTIMIZER, precision="fp32", device=cpu, rows=rows)
    if need is None:
        raise SystemExit(f"{name}: the fake trace cannot run it")
    release_freed()
    before = process_bytes(cpu)
    reset_peak_rss()
    total = len(batch["input_ids"]) if isinstance(batch, dict) else len(batch[0])
    dspark.plan(model, batch, loss_fn, optimizer=OPTIMIZER, devices=[1], global_batch=total, max_micro_batch=rows,
                process_baseline_bytes=0)
    activations = need.one_row_bytes + need.per_row_bytes * (rows - 1)
    print("RESULT " + json.dumps({"state": need.state_bytes, "activations": activations,
                                  "predicted": need.rise_bytes(rows), "measured": peak_rss_bytes() - before}),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "SIZE", "ROWS"), help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES), help="MODEL:SIZE:ROWS, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    rows = []
    for case in args.cases.split(","):
        name, size, probe_rows = case.split(":")
        out = subprocess.run([sys.executable, __file__, "--worker", name, size, probe_rows], capture_output=True,
                             text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{case}: no result\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        got = json.loads(line[len("RESULT "):])
        holds = got["measured"] <= got["predicted"]
        rows.append([name, size, int(probe_rows), round(got["state"] / 1e6, 1), round(got["activations"] / 1e6, 1),
                     round(got["predicted"] / 1e6, 1), round(got["measured"] / 1e6, 1),
                     round(got["measured"] / got["predicted"], 2), "yes" if holds else "NO"])
        print(" | ".join(map(str, rows[-1])), flush=True)
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, columns=COLUMNS, rows=rows,
                    caption="auto's probe (dspark.plan on one CPU core, AdamW, fp32) in a fresh process per row: "
                            "its copy's model state, a step's activations at the probe's larger batch from the "
                            "fake trace, the rise of the process's high water predicted before the probe ran, and "
                            "the rise measured (VmHWM after, less VmRSS before; MB = 10^6 bytes)")


if __name__ == "__main__":
    main()
