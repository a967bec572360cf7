"""What a rank's resident memory is made of, phase by phase: after ``dspark.init`` (the interpreter,
PyTorch and the process group), after building the model, after wrapping it in the engine, after each
step; and the peak over the steps after the first, sampled every 5 ms by a thread with the phase it
fell in. Each line splits the resident memory into anonymous pages (tensors and the heap), file
pages (the libraries) and shared memory (DSpark's transport), from ``/proc/self/status``.

    dspark run --nproc 2 benchmarks/memory_phases.py --workload gpt2-124m --strategy zero3

Linux only (``/proc``). Rank 0 prints; every rank runs the same steps on its own rows.
"""

from __future__ import annotations

import argparse
import functools
import gc
import threading
import time
from pathlib import Path

import torch

import dspark
from dspark.models import get_workload

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def _status_mb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _FIELDS:
            out[key] = int(value.split()[0]) // 1024
    return out


def _line(status: dict[str, int]) -> str:
    return (f"RSS {status['VmRSS']} MB (anon {status['RssAnon']}, files {status['RssFile']}, shared "
            f"{status['RssShmem']}), peak so far {status['VmHWM']} MB")


class _Sampler(threading.Thread):
    """The largest resident memory seen, and the phase it was seen in."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.phase = "idle"
        self.peak: dict[str, int] = {"VmRSS": 0}
        self.peak_phase = ""
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.005):
            status = _status_mb()
            if status["VmRSS"] > self.peak["VmRSS"]:
                self.peak, self.peak_phase = status, self.phase

    def stop(self) -> None:
        self._done.set()
        self.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt2-124m")
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-per-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="steps (the peak covers all but the first)")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: the peak is taken over the steps after the first")
    torch.set_num_threads(1)
    world = dspark.init()

    def report(what: str) -> None:
        gc.collect()
        if world.is_main:
            print(f"{what:<22} {_line(_status_mb())}", flush=True)

    report("after dspark.init")
    workload = get_workload(args.workload)
    model = workload.build_model(seed=0, device=world.device)
    report("after building")
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                           strategy=args.strategy, precision=args.precision)
    del model
    report("after the engine")
    inputs, targets = workload.make_batch(args.batch_per_rank * world.world_size, seed=0,
                                          device=world.device)
    rows = slice(world.rank * args.batch_per_rank, (world.rank + 1) * args.batch_per_rank)
    x, y = inputs[rows].contiguous(), targets[rows].contiguous()
    sampler = _Sampler()
    sampler.start()
    try:
        for step in range(args.steps):
            sampler.phase = f"forward {step}"
            loss = workload.loss(engine(x), y)
            sampler.phase = f"backward {step}"
            engine.backward(loss)
            sampler.phase = f"optimizer {step}"
            engine.step()
            del loss
            sampler.phase = "idle"
            report(f"after step {step}")
            if step == 0:
                time.sleep(0.02)  # the sampler's last look at step 0
                sampler.peak, sampler.peak_phase = {"VmRSS": 0}, ""
    finally:
        sampler.stop()
    if world.is_main:
        print(f"peak over steps 1-{args.steps - 1}, in {sampler.peak_phase}: {_line(sampler.peak)}",
              flush=True)
    engine.close()
    del engine
    gc.collect()
    dspark.shutdown()


if __name__ == "__main__":
    main()
