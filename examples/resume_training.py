"""Resume training after a crash or a preemption: save a sharded checkpoint every few steps, save
and stop when the job is preempted (SIGTERM), and on start continue from the latest checkpoint.

Run it on two CPU cores, with one restart allowed, and make rank 1 crash once at step 7::

    dspark run --nproc 2 --max-restarts 1 examples/resume_training.py --ckpt /tmp/ckpt --steps 12 --crash-at 7

The first attempt saves at steps 4 (and would at 8, 12); rank 1 dies at step 7; the launcher
restarts both workers, which print ``resumed from step 4`` and finish. ``--kill-at 7`` makes the
loss harsher: rank 1 is SIGKILLed (no exception, no cleanup). Send SIGTERM to ``dspark run`` (what
Slurm and Kubernetes do before they preempt) and every rank saves at the same step and exits 0; run
it again and it resumes from there. Checkpoints load at any world size: ``--nproc 1`` or plain
``python examples/resume_training.py --ckpt /tmp/ckpt --steps 16`` continues the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import time
from pathlib import Path

import torch
from torch import nn

import dspark
from dspark.checkpoint import is_checkpoint

GLOBAL_BATCH = 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", type=Path, required=True, help="directory of step-N checkpoints")
    parser.add_argument("--steps", type=int, default=12, help="train until this many steps")
    parser.add_argument("--save-every", type=int, default=4, help="save a checkpoint every K steps")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints to keep (older are deleted)")
    parser.add_argument("--strategy", default="zero2", choices=["replicate", "zero1", "zero2", "zero3"])
    parser.add_argument("--crash-at", type=int, default=None,
                        help="rank 1 fails at this step, on the first attempt only (a lost worker)")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="rank 1 SIGKILLs itself at this step, on the first attempt only")
    parser.add_argument("--async-save", action="store_true",
                        help="write the periodic checkpoints in the background")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds each step also sleeps (to stand in for a bigger model)")
    parser.add_argument("--log-every", type=int, default=0, help="print the loss every K steps (rank 0)")
    return parser.parse_args()


def latest_checkpoint(root: Path) -> Path | None:
    """The step-N checkpoint with the highest N (a save is atomic: any one found is complete)."""
    found = sorted(p for p in root.glob("step-*") if is_checkpoint(p))
    return found[-1] if found else None


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, the same on every rank and in every attempt."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).tanh()  # (B, 16) -> (B, 1)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)  # one worker = one core
    torch.manual_seed(0)
    world = dspark.init()
    # The first call installs the SIGTERM handler: made here, a SIGTERM that arrives while the
    # checkpoint loads is seen at the first step's check, instead of stopping this rank unsaved
    dspark.preemption_requested()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torchrun
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=args.strategy)

    latest = latest_checkpoint(args.ckpt)
    if latest is not None:
        info = engine.load(latest)
        if world.is_main:
            print(f"attempt {attempt}: resumed from step {engine.step_count} ({latest.name}, written by "
                  f"{info.world_size} rank(s) with {info.strategy})", flush=True)
    elif world.is_main:
        print(f"attempt {attempt}: no checkpoint in {str(args.ckpt)!r}, starting from step 0", flush=True)

    loss = None
    for step in range(engine.step_count, args.steps):
        if world.rank == 1 and attempt == 0:
            if step == args.crash_at:
                raise SystemExit(f"rank 1: simulated crash at step {step} (attempt {attempt})")
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = dspark.distribute_batch(batch(step), shard_dim=0)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        time.sleep(args.step_sleep)
        if world.is_main and args.log_every and engine.step_count % args.log_every == 0:
            print(f"attempt {attempt}: step {engine.step_count} loss {loss.item():.4f}", flush=True)
        if dspark.preemption_requested():  # SIGTERM reached the job: every rank agrees here
            engine.save(args.ckpt / f"step-{engine.step_count:06d}")
            if world.is_main:
                print(f"attempt {attempt}: preempted, saved at step {engine.step_count}", flush=True)
            break
        if engine.step_count % args.save_every == 0 or engine.step_count == args.steps:
            engine.save(args.ckpt / f"step-{engine.step_count:06d}", async_save=args.async_save)
            if world.is_main:  # keep the newest few; a reader never sees a half-deleted latest
                for old in sorted(args.ckpt.glob("step-*"))[: -args.keep]:
                    shutil.rmtree(old, ignore_errors=True)

    # a fingerprint of the final weights: a resumed run ends where an uninterrupted one does
    checksum = sum(float(t.double().sum()) for t in engine.full_state_dict().values())  # collective
    if world.is_main:
        last = "n/a" if loss is None else f"{loss.item():.4f}"
        print(f"attempt {attempt}: finished at step {engine.step_count} of {args.steps} on "
              f"{world.world_size} rank(s), last loss {last}, weights checksum {checksum:.10f}",
              flush=True)
    dspark.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
