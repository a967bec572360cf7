"""Peak resident memory per rank while pretrained weights are loaded into a sharded model, three ways:

* ``load_pretrained``: DSpark zero3, every rank reads its rows of the safetensors files;
* ``from_rank0``: DSpark zero3, rank 0 reads the whole state dict, ``engine.load_full_state_dict(sd,
  src_rank=0)`` sends it tensor by tensor (the other ranks pass None);
* ``fsdp2``: PyTorch's FSDP2 (``fully_shard`` per block), rank 0 reads the whole state dict,
  ``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``.

The model is HuggingFace's GPT-2 built from a config (default: GPT-2 medium, 355M parameters) on
the meta device, so it never exists whole on a rank before the load. First write the weights once
(one process), then measure each method in its own launch (a peak is per process)::

    python benchmarks/pretrained_load_rss.py --prepare /tmp/gpt2-medium
    dspark run --nproc 2 benchmarks/pretrained_load_rss.py --weights /tmp/gpt2-medium --method load_pretrained
    dspark run --nproc 2 benchmarks/pretrained_load_rss.py --weights /tmp/gpt2-medium --method from_rank0
    dspark run --nproc 2 benchmarks/pretrained_load_rss.py --weights /tmp/gpt2-medium --method fsdp2

Each rank prints its RSS with the libraries loaded (before the model), before the load (after
``malloc_trim``), the peak during it (sampled every 2 ms by a thread), the peak of its anonymous
memory alone (``RssAnon``: what is not file pages, such as the safetensors files ``safe_open`` maps),
and the bytes of parameters it holds after it. Linux only (``/proc``).

``--out DIR`` alone does all of it (the weights in a temporary directory, then each method in its
own ``dspark run --nproc 2``) and writes the table docs/figures.md publishes as ``DIR/table.json``
(see [Note: table artifacts])::

    python benchmarks/pretrained_load_rss.py --out DIR
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import dspark

MIB = 2**20
METHODS = {
    "load_pretrained": "`engine.load_pretrained(dir)`",
    "from_rank0": "`engine.load_full_state_dict(sd, src_rank=0)` (rank 0 reads the file whole first)",
    "fsdp2": "FSDP2 `set_model_state_dict(..., broadcast_from_rank0=True)` (rank 0 reads the file whole first)",
}


def _config(layers: int, width: int) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=1024,
                      vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _trim() -> None:
    """Collect garbage and give the heap's free memory back to the system (glibc), so that "before"
    is what the process holds, not what materialising the model freed and kept for reuse."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


class _PeakSampler:
    """The largest RSS seen while the ``with`` block runs (a thread samples every 2 ms)."""

    def __enter__(self) -> _PeakSampler:
        self.peak = _rss_bytes()
        self.peak_anon = _status_bytes("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self.peak_anon = max(self.peak_anon, _status_bytes("RssAnon"))
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def prepare(directory: Path, layers: int, width: int) -> None:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config(layers, width))
    model.save_pretrained(directory)
    count = sum(p.numel() for p in model.parameters())
    print(f"wrote {directory}: GPT-2 with {layers} layers, width {width}: {count:,} parameters")


def _full_state_dict_on_rank0(weights: Path) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    if dspark.get_world().rank != 0:
        return None
    files = sorted(weights.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: stored once
    return state


def measure(weights: Path, method: str, layers: int, width: int) -> None:
    from transformers import GPT2LMHeadModel

    world = dspark.init(backend="gloo")
    config = _config(layers, width)
    libraries = _rss_bytes()  # the interpreter, PyTorch, transformers, the process group
    if method == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        _trim()
        before = _rss_bytes()
        with _PeakSampler() as sampler:
            state = _full_state_dict_on_rank0(weights)
            set_model_state_dict(model, state or {}, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True))
            del state
        held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    else:
        with dspark.meta_init():
            model = GPT2LMHeadModel(config)
        engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.0), strategy="zero3",
                               batch_check_every=None)
        _trim()
        before = _rss_bytes()
        with _PeakSampler() as sampler:
            if method == "load_pretrained":
                engine.load_pretrained(weights)
            else:
                state = _full_state_dict_on_rank0(weights)
                engine.load_full_state_dict(state, src_rank=0)
                del state
        held = sum(d.local.numel() * d.local.element_size() for d in engine.sharded_parameters().values())
    num_params = sum(p.numel() for p in GPT2LMHeadModel(config).parameters()) if world.rank == 0 else 0
    figures = dspark.comm.all_gather_object({"libraries_mib": libraries / MIB, "before_mib": before / MIB,
                                             "peak_mib": sampler.peak / MIB, "held_mib": held / MIB})
    lines = dspark.comm.all_gather_object(
        f"rank {world.rank}: RSS with the libraries only {libraries / MIB:.0f} MiB, before the load "
        f"{before / MIB:.0f} MiB, peak during the load {sampler.peak / MIB:.0f} MiB "
        f"(+{(sampler.peak - before) / MIB:.0f} MiB; anonymous memory alone peaked at "
        f"{sampler.peak_anon / MIB:.0f} MiB, the rest is file pages mapped by safetensors), parameters "
        f"held after {held / MIB:.0f} MiB")
    if world.rank == 0:
        print(f"{method}: GPT-2 {layers} layers, width {width}, {num_params:,} parameters "
              f"({num_params * 4 / MIB:.0f} MiB in fp32) on {world.world_size} ranks")
        for line in lines:
            print("  " + line)
        print("RESULT " + json.dumps({"method": method, "num_params": num_params, "ranks": figures}),
              flush=True)
    dspark.shutdown()


def measure_all(out: Path, layers: int, width: int, nproc: int) -> None:
    """Every method in its own launch on weights written to a temporary directory; ``out/table.json``."""
    from dspark.bench.artifacts.table import write_table

    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dspark_cli = str(Path(sys.executable).with_name("dspark"))
    shape = ["--layers", str(layers), "--width", str(width)]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, __file__, "--prepare", tmp, *shape], check=True, env=env)
        for method in METHODS:
            done = subprocess.run([dspark_cli, "run", "--nproc", str(nproc), __file__, "--weights", tmp,
                                   "--method", method, *shape], check=True, env=env, text=True,
                                  stdout=subprocess.PIPE)
            print(done.stdout, end="", flush=True)
            results.append(next(json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
                                if line.startswith("RESULT ")))
    ranks = range(nproc)
    rows = [[METHODS[r["method"]], *(f"{r['ranks'][k]['before_mib']:.0f} -> {r['ranks'][k]['peak_mib']:.0f}"
                                     for k in ranks),
             " / ".join(f"{rank['held_mib']:.0f}" for rank in r["ranks"])] for r in results]
    num_params = results[0]["num_params"]
    first = results[0]["ranks"][0]["libraries_mib"]
    write_table(out, columns=["method (zero3 / FSDP2)", *(f"rank {k}: before the load -> peak MiB" for k in ranks),
                              "parameters held after, MiB per rank"], rows=rows,
                caption=f"GPT-2, {layers} layers of width {width}: {num_params:,} parameters "
                        f"({num_params * 4 / MIB:.0f} MiB in fp32), built on meta, on {nproc} CPU ranks "
                        f"(gloo). Peak RSS per rank during the load, sampled every 2 ms; each method in "
                        f"its own launch. The interpreter, PyTorch and `transformers` alone: "
                        f"{first:.0f} MiB on rank 0.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=Path, help="write the model's weights into this directory and exit")
    parser.add_argument("--weights", type=Path, help="the directory --prepare wrote")
    parser.add_argument("--method", choices=("load_pretrained", "from_rank0", "fsdp2"), default="load_pretrained")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, with --out")
    parser.add_argument("--out", type=Path, help="measure every method; write DIR/table.json")
    args = parser.parse_args()
    if args.out is not None:
        measure_all(args.out, args.layers, args.width, args.nproc)
    elif args.prepare is not None:
        prepare(args.prepare, args.layers, args.width)
    elif args.weights is not None:
        measure(args.weights, args.method, args.layers, args.width)
    else:
        parser.error("give --out DIR, --prepare DIR or --weights DIR")


if __name__ == "__main__":
    main()
