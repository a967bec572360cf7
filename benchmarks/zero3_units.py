"""zero3's step with three choices of units, on 2 ranks, interleaved:

* ``every container child``: every child of an ``nn.ModuleList`` / ``nn.Sequential`` at any depth
  (DSpark's default until a unit nested in another needed 1 MiB of parameters): on resnet50-cpu 31
  units, 22 of them under 100 KB (a BatchNorm of 32 parameters is its own all-gather);
* ``default``: DSpark's default units (see [Note: units] in ``dspark.engine.zero3_plan``);
* ``coarse``: only the modules ``--coarse`` names (default: resnet50-cpu's four stages).

Each round builds the model and an engine per choice, in alternating order, and times ``--steps``
steps after one warm-up step; rank 0 prints each choice's median step per round and the median
over rounds.

    dspark run --nproc 2 benchmarks/zero3_units.py --workload resnet50-cpu --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import gc

import torch

import dspark
from dspark.bench.measure.barrier_timing import median_step_ms
from dspark.bench.measure.rounds import interleaved_rounds
from dspark.engine.for_the_lab import unit_modules
from dspark.models import get_workload


def _container_children(model: torch.nn.Module) -> set[str]:
    return {f"{name}.{child}" if name else child for name, module in model.named_modules()
            if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
            for child, _ in module.named_children()}


def _step_ms(workload_name: str, units: tuple[str, ...] | str | None, steps: int,
             global_batch: int) -> tuple[int, float]:
    workload = get_workload(workload_name)
    model = workload.build_model(seed=0)
    if units == "every container child":
        units = tuple(_container_children(model))
    policy = None if units is None else (lambda name, module: name in units)
    num_units = len(unit_modules(model, policy))  # the root included
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                           strategy="zero3", broadcast_buffers=True,
                           **({} if policy is None else {"zero3_units": policy}))
    del model
    return num_units, median_step_ms(engine, workload, global_batch, steps, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="resnet50-cpu")
    parser.add_argument("--coarse", default="stages.0,stages.1,stages.2,stages.3",
                        help="comma-separated module names that become the units")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = dspark.init()
    policies: dict[str, tuple[str, ...] | str | None] = {
        "every container child": "every container child", "default": None,
        "coarse": tuple(args.coarse.split(","))}
    def measure(units: tuple[str, ...] | str | None) -> tuple[str, float]:
        count, ms = _step_ms(args.workload, units, args.steps, args.global_batch)
        return f" ({count} units)", ms

    interleaved_rounds({name: functools.partial(measure, units) for name, units in policies.items()},
                        args.rounds, verbose=world.is_main)
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
