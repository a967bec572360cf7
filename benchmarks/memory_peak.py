"""What one training step's tensor peak is made of: plain PyTorch on one core (the compute every engine
shares), PyTorch profiler's memory timeline of one step after a warm-up step, printed at its peak by
category (parameters, optimizer state, gradients, activations, autograd's own), with when the peak
happens. It tells which part of a step an engine's memory work can reach: gradients and buffers
that are not alive at the peak cannot lower it.

    OMP_NUM_THREADS=1 python benchmarks/memory_peak.py --workload gpt2-124m --batch 1
    OMP_NUM_THREADS=1 python benchmarks/memory_peak.py --workload resnet50-cpu --batch 64 --precision bf16
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import tempfile
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from dspark.models.registry import get_workload

# the columns of export_memory_timeline's sizes (torch/profiler/_memory_profiler.py: a leading 0,
# then _CATEGORY_TO_INDEX's order, uncategorised last)
CATEGORIES = ("", "parameter", "optimizer state", "input", "temporary", "activation", "gradient",
              "autograd detail", "uncategorised")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-124m")
    parser.add_argument("--batch", type=int, default=1, help="samples in the step")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workload = get_workload(args.workload)
    model = workload.build_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inputs, targets = workload.make_batch(args.batch, seed=0)
    autocast = (functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext)

    def step() -> None:
        with autocast():
            loss = workload.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state exists from here on, as in every later step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the timeline export is marked for removal
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path)
        with open(path) as f:
            times, sizes = json.load(f)
    totals = [sum(row) for row in sizes]
    peak = max(range(len(totals)), key=totals.__getitem__)
    span = (times[-1] - times[0]) or 1
    print(f"{args.workload}, batch {args.batch}, {args.precision}, AdamW: tensor peak "
          f"{totals[peak] / 2**20:.0f} MiB at {100 * (times[peak] - times[0]) / span:.0f}% of the step")
    for name, nbytes in zip(CATEGORIES, sizes[peak], strict=False):
        if name:
            print(f"  {name:16s} {nbytes / 2**20:8.0f} MiB")


if __name__ == "__main__":
    main()
