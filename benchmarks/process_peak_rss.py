"""The whole process's peak resident memory (``VmHWM``: what the kernel counted at the worst moment,
no ``malloc_trim`` anywhere) per rank and per phase, when a pretrained model gets onto 2 CPU ranks
three ways:

* ``documented``: DSpark's documented path, ``dspark.meta_init()`` + ``from_config``, then
  ``dspark.Engine(strategy="zero3")``, then ``engine.load_pretrained(dir)``;
* ``naive``: ``from_pretrained(dir)`` on every rank, then ``dspark.Engine(strategy="zero3")``;
* ``fsdp2``: PyTorch's FSDP2, the model built on ``torch.device("meta")``, ``fully_shard`` per block
  and on the root, ``to_empty(device="cpu")``, then rank 0 reads the file whole and
  ``set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True))``.

The promise the documented path makes: no rank ever holds the whole model, so its peak stays below
what the process holds with the libraries loaded plus one whole copy of the model. ``VmHWM`` is read
after each phase (it only grows: each row is the peak up to the end of that phase), ``VmRSS`` beside
it. The model is HuggingFace's GPT-2 built from a config (default: GPT-2 medium). Linux only::

    python benchmarks/process_peak_rss.py --out DIR           # all three paths; DIR/table.json
    python benchmarks/process_peak_rss.py --prepare W         # or by hand: the weights once, then
    dspark run --nproc 2 benchmarks/process_peak_rss.py --weights W --path documented
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import dspark

MIB = 2**20
PATHS = {
    "documented": "DSpark: meta_init + from_config, Engine zero3, load_pretrained",
    "naive": "from_pretrained on every rank, then Engine zero3",
    "fsdp2": "FSDP2: meta, fully_shard, to_empty, set_model_state_dict(broadcast_from_rank0)",
}


def _config(layers: int, width: int) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=1024,
                      vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no {field} in /proc/self/status")


def prepare(directory: Path, layers: int, width: int) -> None:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config(layers, width))
    model.save_pretrained(directory)
    print(f"wrote {directory}: {sum(p.numel() for p in model.parameters()):,} parameters")


def measure(weights: Path, path: str, layers: int, width: int) -> None:
    from transformers import GPT2LMHeadModel

    world = dspark.init(backend="gloo")
    config = _config(layers, width)
    phases: list[tuple[str, float, float]] = []

    def phase(name: str) -> None:
        dspark.comm.barrier()
        phases.append((name, _status_mib("VmHWM"), _status_mib("VmRSS")))

    phase("libraries (interpreter, PyTorch, transformers, process group)")
    sgd = functools.partial(torch.optim.SGD, lr=0.0)
    if path == "documented":
        with dspark.meta_init():
            model = GPT2LMHeadModel(config)
        phase("meta_init + from_config")
        engine = dspark.Engine(model, optimizer=sgd, strategy="zero3", batch_check_every=None)
        phase("Engine zero3 (materialised, one unit at a time)")
        engine.load_pretrained(weights)
        phase("load_pretrained")
    elif path == "naive":
        model = GPT2LMHeadModel.from_pretrained(weights)
        phase("from_pretrained")
        engine = dspark.Engine(model, optimizer=sgd, strategy="zero3", batch_check_every=None)
        phase("Engine zero3")
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        phase("meta, fully_shard, to_empty")
        state: dict[str, torch.Tensor] = {}
        if world.rank == 0:
            for file in sorted(weights.glob("*.safetensors")):
                state.update(load_file(file))
            state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: stored once
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=True))
        del state
        phase("set_model_state_dict(broadcast_from_rank0)")
    everyone = dspark.comm.all_gather_object(phases)
    if world.rank == 0:
        print("RESULT " + json.dumps({"path": path, "ranks": everyone}), flush=True)
    dspark.shutdown()


def measure_all(out: Path, layers: int, width: int, nproc: int) -> None:
    """Every path in its own launch (a peak is per process), on weights written once; ``out/table.json``."""
    from transformers import GPT2LMHeadModel

    from dspark.bench.artifacts.table import write_table

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dspark_cli = str(Path(sys.executable).with_name("dspark"))
    shape = ["--layers", str(layers), "--width", str(width)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, __file__, "--prepare", tmp, *shape], check=True, env=env)
        for path in PATHS:
            done = subprocess.run([dspark_cli, "run", "--nproc", str(nproc), __file__, "--weights", tmp,
                                   "--path", path, *shape], check=True, env=env, text=True,
                                  stdout=subprocess.PIPE)
            print(done.stdout, end="", flush=True)
            results.append(next(json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
                                if line.startswith("RESULT ")))
    with torch.device("meta"):
        num_params = sum(p.numel() for p in GPT2LMHeadModel(_config(layers, width)).parameters())
    model_mib = num_params * 4 / MIB
    rows = []
    for result in results:
        ranks = result["ranks"]
        for i, (name, _, _) in enumerate(ranks[0]):
            rows.append([PATHS[result["path"]] if i == 0 else "", name,
                         *(f"{r[i][1]:.0f} ({r[i][2]:.0f})" for r in ranks),
                         " / ".join(f"{r[i][1] - r[0][1]:.0f}" for r in ranks)])
    write_table(out, columns=["path", "phase", *(f"rank {k}: VmHWM (VmRSS) MiB" for k in range(nproc)),
                              "peak above the libraries, MiB per rank"], rows=rows,
                caption=f"GPT-2, {layers} layers of width {width}: {num_params:,} parameters "
                        f"({model_mib:.0f} MiB in fp32), on {nproc} CPU ranks (gloo). Each rank's whole-"
                        f"process peak resident memory (VmHWM, no malloc_trim) at the end of each phase, "
                        f"its resident memory then in brackets; each path in its own launch. The "
                        f"promise: every rank's peak below its libraries plus one whole model "
                        f"({model_mib:.0f} MiB).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=Path, help="write the model's weights into this directory and exit")
    parser.add_argument("--weights", type=Path, help="the directory --prepare wrote")
    parser.add_argument("--path", choices=sorted(PATHS), default="documented")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, with --out")
    parser.add_argument("--out", type=Path, help="measure every path; write DIR/table.json")
    args = parser.parse_args()
    if args.out is not None:
        measure_all(args.out, args.layers, args.width, args.nproc)
    elif args.prepare is not None:
        prepare(args.prepare, args.layers, args.width)
    elif args.weights is not None:
        measure(args.weights, args.path, args.layers, args.width)
    else:
        parser.error("give --out DIR, --prepare DIR or --weights DIR")


if __name__ == "__main__":
    main()
