"""DSpark's engine against plain PyTorch on ONE device, side by side in one process: the seed's
configuration (global batch 256, fp16, AdamW) at real size, micro-batched where a batch does not
fit, so that the engine's own cost on a device is a measurement, not a belief.

    python benchmarks/one_device_vs_pytorch.py                      # ResNet-50 and GPT-2 124M, GPU
    python benchmarks/one_device_vs_pytorch.py --workloads resnet50-cpu,gpt2-cpu \
        --global-batch 8 --micro-batch 4 --precision fp32 --rounds 2 --steps 2   # a CPU smoke run

Three choices per workload, each on its own copy of the model built from the same seed, trained on
the same batch, measured in interleaved rounds (the order rotates each round, so drift over the run
favours none):

* ``dspark``: ``dspark.Engine(strategy="replicate", precision=P, grad_accum_steps=K)`` with
  ``engine.backward`` / ``engine.step`` (DSpark turns on the fused AdamW kernel where the device
  has one);
* ``torch``: the loop PyTorch's AMP recipe writes: ``torch.autocast`` + ``torch.amp.GradScaler``
  (fp16), ``loss / K`` per micro-batch, with ``--clip`` ``scaler.unscale_`` +
  ``clip_grad_norm_``, ``AdamW`` with PyTorch's default kernel;
* ``torch-fused``: the same with ``AdamW(fused=True)``: the fastest plain-PyTorch optimizer step.

A step is the whole global batch: K forward/backward passes of ``global_batch / K`` samples and one
optimizer step, timed between two device synchronisations. Peak memory is measured for each choice
in isolation, after the timed rounds (CUDA only): every choice is freed, then each is built alone,
the allocator's peak reset, and ``--steps`` steps run; the peak is what that choice allocated above
the shared input batch (model, gradients, optimizer state, activations, its own buffers). While the
rounds run, all three choices are alive at once, so a process-wide peak then would count the other
two choices' model state in every choice's figure. One device has nothing to communicate, so what separates
``dspark`` from ``torch`` is the engine's own work per step (hooks, buckets, the loss scaler's
overflow check, the step observer) against the optimizer kernel it picks.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import dspark
from dspark.bench.measure.rounds import round_order
from dspark.models import get_workload

_SEED = 0
_LR = 3e-4
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dspark_step(workload: Any, precision: str, micro: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, *, clip: float | None
                 ) -> tuple[Callable[[], None], Callable[[], None]]:
    model = workload.build_model(seed=_SEED, device=device)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=_LR),
                           strategy="replicate", precision=precision, grad_accum_steps=len(micro),
                           clip_grad_norm=clip)

    def step() -> None:
        for x, y in micro:
            engine.backward(workload.loss(engine(x), y))
        engine.step()

    return step, engine.close


def _torch_step(workload: Any, precision: str, micro: list[tuple[torch.Tensor, torch.Tensor]],
                device: torch.device, *, fused: bool, clip: float | None
                ) -> tuple[Callable[[], None], Callable[[], None]]:
    model = workload.build_model(seed=_SEED, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR, **({"fused": True} if fused else {}))
    dtype = _AUTOCAST[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    k = len(micro)

    def step() -> None:
        for x, y in micro:
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = workload.loss(model(x), y)
            scaler.scale(loss / k).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    def close() -> None:
        optimizer.state.clear()

    return step, close


def measure(name: str, *, global_batch: int, micro_batch: int, precision: str, rounds: int,
            steps: int, warmup: int, device: torch.device, profile: bool = False,
            clip: float | None = None) -> dict[str, Any]:
    """Interleaved rounds of the three choices on workload ``name``; a dict of their step times
    (ms, every timed step by round) and peak allocated bytes; with ``profile``, each choice's
    profile of two more steps (:func:`_profile`)."""
    if global_batch % micro_batch:
        raise SystemExit(f"--global-batch {global_batch} is not a multiple of --micro-batch {micro_batch}")
    workload = get_workload(name)
    inputs, targets = workload.make_batch(global_batch, seed=_SEED, device=device)
    micro = list(zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True))
    builders: dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]] = {
        "dspark": lambda: _dspark_step(workload, precision, micro, device, clip=clip),
        "torch": lambda: _torch_step(workload, precision, micro, device, fused=False, clip=clip),
        "torch-fused": lambda: _torch_step(workload, precision, micro, device, fused=True, clip=clip),
    }
    built = {choice: build() for choice, build in builders.items()}
    times: dict[str, list[list[float]]] = {choice: [] for choice in built}
    peaks: dict[str, int] = {choice: 0 for choice in built}
    names = list(built)
    for round_index in range(rounds):
        for choice in round_order(names, round_index):
            step, _ = built[choice]
            for _ in range(warmup if round_index == 0 else 0):
                step()
            round_ms = []
            for _ in range(steps):
                _sync(device)
                start = time.perf_counter()
                step()
                _sync(device)
                round_ms.append((time.perf_counter() - start) * 1e3)
            times[choice].append(round_ms)
            print(f"{name} round {round_index} {choice:<11} median step "
                  f"{statistics.median(round_ms):8.1f} ms", flush=True)
    profiles = {choice: _profile(step, device) for choice, (step, _) in built.items()} if profile else {}
    for _, close in built.values():
        close()
    built.clear()
    _free(device)
    if device.type == "cuda":
        peaks = {choice: _isolated_peak(build, steps=steps, device=device)
                 for choice, build in builders.items()}
    return {"workload": name, "global_batch": global_batch, "micro_batch": micro_batch,
            "precision": precision, "clip": clip, "times_ms": times, "peak_allocated_bytes": peaks,
            "profiles": profiles}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _isolated_peak(build: Callable[[], tuple[Callable[[], None], Callable[[], None]]], *,
                   steps: int, device: torch.device) -> int:
    """One choice's peak, alone on the device: built after every other choice was freed, the
    allocator's peak reset, ``steps`` steps run; the bytes allocated above what was there before
    it was built (the shared input batch)."""
    _free(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step, close = build()
    for _ in range(max(steps, 2)):  # the optimizer's state appears at the first step
        step()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    close()
    _free(device)
    return peak


_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                "aten::_local_scalar_dense", "aten::item")


def _profile(step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Two steps under ``torch.profiler``: the top operators by self CPU time, each choice's host
    synchronisations, kernel launches and their device time, as text and counts."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()  # outside the profile: the first step under a profiler also pays its set-up
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        _sync(device)
    events = prof.key_averages()
    counts = {e.key: e.count // 2 for e in events if e.key in _SYNC_EVENTS}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cudaLaunchKernelExC")) // 2
    table = events.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48)
    return {"syncs_per_step": counts, "kernel_launches_per_step": launches, "table": table}


def summarise(result: dict[str, Any]) -> list[str]:
    """Lines: each choice's median step (rounds' medians min-max), samples/s, peak memory, and the
    median over rounds of DSpark's step / each PyTorch choice's step in the same round."""
    times = result["times_ms"]
    medians = {c: [statistics.median(r) for r in rounds] for c, rounds in times.items()}
    lines = []
    for choice, per_round in medians.items():
        mid = statistics.median(per_round)
        peak = result["peak_allocated_bytes"][choice]
        lines.append(f"  {choice:<11} {mid:8.1f} ms/step (rounds {min(per_round):.1f}-"
                     f"{max(per_round):.1f}), {result['global_batch'] / mid * 1e3:8.1f} samples/s"
                     + (f", peak {peak / 2**30:.2f} GiB allocated alone" if peak else ""))
    for peer in ("torch", "torch-fused"):
        ratios = [d / p for d, p in zip(medians["dspark"], medians[peer], strict=True)]
        lines.append(f"  dspark / {peer:<11} {statistics.median(ratios):.3f} "
                     f"(rounds {min(ratios):.3f}-{max(ratios):.3f}; below 1: DSpark faster)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="resnet50,gpt2-124m")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--micro-batch", default="resnet50=256,gpt2-124m=32",
                        help="samples per forward/backward: N for every workload, or "
                             "WORKLOAD=N,... (a workload not named runs its whole batch at once)")
    parser.add_argument("--precision", choices=sorted(_AUTOCAST), default="fp16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per choice per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per choice, first round")
    parser.add_argument("--json", default=None, help="also write every timing to this file")
    parser.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                        help="clip the global gradient norm: clip_grad_norm= for DSpark, "
                             "unscale_ + clip_grad_norm_ for PyTorch")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds, profile two steps of each choice: host "
                             "synchronisations and kernel launches per step, top operators")
    args = parser.parse_args(argv)
    if "=" in args.micro_batch:
        micro = {k: int(v) for k, v in (item.split("=") for item in args.micro_batch.split(","))}
    else:
        micro = {}
    world = dspark.init()
    device = world.device
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", torch {torch.__version__}, precision {args.precision}, global batch "
          f"{args.global_batch}, {args.rounds} rounds x {args.steps} steps", flush=True)
    results = []
    for name in args.workloads.split(","):
        mb = micro.get(name, args.global_batch) if micro else int(args.micro_batch)
        result = measure(name, global_batch=args.global_batch, micro_batch=mb,
                         precision=args.precision, rounds=args.rounds, steps=args.steps,
                         warmup=args.warmup, device=device, profile=args.profile, clip=args.clip)
        print(f"{name}: global batch {args.global_batch} as {args.global_batch // mb} x {mb}, "
              f"{args.precision}, AdamW" + (f", clip {args.clip:g}" if args.clip else ""))
        print("\n".join(summarise(result)), flush=True)
        for choice, prof in result["profiles"].items():
            print(f"{name} {choice}: per step {prof['kernel_launches_per_step']} kernel launches, "
                  f"host syncs {prof['syncs_per_step']}\n{prof['table']}", flush=True)
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "results": results}, f, indent=1)
    dspark.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
