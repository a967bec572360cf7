"""zero3's parameter gathers alone, the two ways they can land, on N ranks, one core each: for every
unit of a workload's model (the engine's default units), the shards of its parameters are gathered

- ``packed``: into one (N, shards) buffer (``comm.all_gather_into_tensor`` of the shards laid end to
  end), then each parameter's column copied out into its own full storage (zero3 before
  ``comm.all_gather_parts``);
- ``parts``: with ``comm.all_gather_parts``, each rank's shard read from its own tensor and written
  straight into each parameter's full storage (what zero3 does now).

One measurement is one pass over every unit, as a forward gathers them; the two ways alternate in
``--rounds`` rounds (the order rotating) of ``--repeats`` passes each, median ms per pass.

    dspark run --nproc 2 benchmarks/zero3_gather.py --workload gpt2-cpu
    dspark run --nproc 2 benchmarks/zero3_gather.py --workload resnet50-cpu --rounds 5
"""

from __future__ import annotations

import argparse
import functools
import gc

import torch

import dspark
from dspark import comm
from dspark.bench.measure.barrier_timing import median_call_ms
from dspark.bench.measure.rounds import interleaved_rounds
from dspark.engine.for_the_lab import unit_modules
from dspark.models import get_workload


def _unit_shards(workload: str, n: int) -> list[list[torch.Tensor]]:
    """Each unit's parameters as the shards a rank holds (1/N of the rows, padded), by unit."""
    model = get_workload(workload).build_model(seed=0)
    units = unit_modules(model)
    seen: set[int] = set()
    out = []
    for _, module in reversed(units):   # the innermost first, so that a parent takes what is left
        shards = []
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            rows = p.shape[0] if p.dim() else 1
            chunk = -(-rows // n)
            shards.append(torch.randn(chunk * (p.numel() // max(rows, 1))))
        if shards:
            out.append(shards)
    return out


def _packed(units: list[list[torch.Tensor]], n: int) -> None:
    for shards in units:
        send = torch.cat(shards)
        out = send.new_empty((n, send.numel()))
        comm.all_gather_into_tensor(out, send)
        at = 0
        for s in shards:
            out[:, at:at + s.numel()].contiguous().view(-1)
            at += s.numel()


def _parts(units: list[list[torch.Tensor]], n: int) -> None:
    for shards in units:
        comm.all_gather_parts(shards, [s.new_empty(n * s.numel()) for s in shards])


def _pass_ms(fn: functools.partial[None], repeats: int) -> tuple[str, float]:
    return "", median_call_ms(fn, repeats, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = dspark.init()
    units = _unit_shards(args.workload, world.world_size)
    if world.is_main:
        total = sum(s.numel() for u in units for s in u) * 4 * world.world_size
        print(f"{args.workload}: {len(units)} units, {sum(map(len, units))} parameters, "
              f"{total / 1e6:.1f} MB gathered per pass, {world.world_size} ranks through "
              f"{comm.transport()!r}", flush=True)
    n = world.world_size
    interleaved_rounds({
        "packed": functools.partial(_pass_ms, functools.partial(_packed, units, n), args.repeats),
        "parts": functools.partial(_pass_ms, functools.partial(_parts, units, n), args.repeats),
    }, args.rounds, verbose=world.is_main)
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
