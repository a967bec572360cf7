"""Where zero3's step goes beyond replicate's: timers wrapped around the engine's own functions
(the gathers' launch and landing, the shared-memory transport's wait loop, saved-tensor packing,
freeing), per step on rank 0, after two warm-up steps.

    dspark run --nproc 2 benchmarks/zero3_overhead.py --strategy zero3
    dspark run --nproc 2 benchmarks/zero3_overhead.py --strategy replicate

The timers cost a little themselves: compare the step times of the two runs, not to the lab's.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

import dspark
from dspark.comm import shm_transport
from dspark.engine import grad_reducer, param_slot, zero3_gather, zero3_saved
from dspark.models import get_workload

_spent: collections.defaultdict[str, float] = collections.defaultdict(float)
_calls: collections.Counter[str] = collections.Counter()


def _time(owner: Any, method: str, label: str) -> None:
    inner: Callable[..., Any] = getattr(owner, method)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _spent[label] += time.perf_counter() - start
            _calls[label] += 1

    setattr(owner, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="resnet50-cpu")
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    for owner, method, label in (
            (zero3_gather.Gather, "__init__", "gather launch"),
            (zero3_gather.Gather, "finish", "gather landing (with its wait)"),
            (shm_transport.ShmTransport, "_spin", "transport wait loop (every collective)"),
            (zero3_saved.SavedParams, "pack", "saved-tensor pack"),
            (zero3_saved.SavedParams, "unpack", "saved-tensor unpack"),
            (param_slot.ParamSlot, "free_full", "free a parameter"),
            (grad_reducer.GradReducer, "on_grad", "gradient into its bucket")):
        _time(owner, method, label)
    torch.set_num_threads(1)
    world = dspark.init()
    workload = get_workload(args.workload)
    engine = dspark.Engine(workload.build_model(seed=0), strategy=args.strategy,
                           optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                           precision=args.precision)
    inputs, targets = workload.make_batch(args.global_batch, seed=0)
    share = args.global_batch // world.world_size
    rows = slice(world.rank * share, (world.rank + 1) * share)
    for step in range(2 + args.steps):
        if step == 2:
            _spent.clear()
            _calls.clear()
            start = time.perf_counter()
        dspark.comm.barrier()
        engine.backward(workload.loss(engine(inputs[rows]), targets[rows]))
        engine.step()
    per_step = (time.perf_counter() - start) / args.steps
    if world.is_main:
        print(f"{args.workload}, {args.strategy}, {args.precision}: {per_step * 1e3:.1f} ms a step "
              f"(timers included), {args.steps} steps")
        for label, seconds in _spent.items():
            print(f"  {label:40s} {seconds / args.steps * 1e3:7.2f} ms a step, "
                  f"{_calls[label] // args.steps} calls")
    engine.close()
    del engine
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
