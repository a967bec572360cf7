"""Run by ``test_process_peak.py`` under ``dspark run --nproc 2``: DSpark's documented path for a
pretrained model (``meta_init()`` + ``from_config``, ``Engine(strategy="zero3")``,
``load_pretrained``), each rank reporting what it holds with the libraries loaded (``VmRSS``, the
collectives' shared memory touched) and its whole-process peak (``VmHWM``) after each phase. Rank 0
writes ``{"phases": [[(name, VmHWM bytes), ...] per rank]}`` to ``OUT``."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

import dspark
from dspark.comm.shm_setup import region_bytes
from tests.meta.test_process_peak import config


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_bytes() -> int:
    return status_bytes("VmHWM")


def main() -> None:
    from transformers import GPT2LMHeadModel

    weights, out = sys.argv[1], sys.argv[2]
    world = dspark.init(backend="gloo")
    # the collectives' shared memory between ranks, touched once, counts with the libraries
    region = torch.zeros(region_bytes() // 4)
    dspark.comm.all_gather_into_tensor(torch.empty(world.world_size * region.numel()), region)
    del region
    phases = [("libraries", status_bytes("VmRSS"))]
    with dspark.meta_init():
        model = GPT2LMHeadModel(config())
    phases.append(("meta_init", peak_bytes()))
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.0), strategy="zero3",
                           batch_check_every=None)
    phases.append(("engine", peak_bytes()))
    engine.load_pretrained(weights)
    phases.append(("load_pretrained", peak_bytes()))
    everyone = dspark.comm.all_gather_object(phases)
    if world.rank == 0:
        Path(out).write_text(json.dumps({"phases": everyone}))
    engine.close()
    dspark.shutdown()


if __name__ == "__main__":
    main()
