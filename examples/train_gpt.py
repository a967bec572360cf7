"""Train a small GPT-2-style model with DSpark, on synthetic text, on 1..N devices.

    dspark run --nproc 2 examples/train_gpt.py --strategy zero2 --precision bf16
    dspark run --nproc 2 examples/train_gpt.py --strategy auto --memory-budget-mib 1000 --seq-len 512 --vocab 8192
    python examples/train_gpt.py                      # one process, same code

Every rank builds the same model and draws the same global batch; distribute_batch keeps this rank's
rows (strong scaling), split into the engine's micro-batches. With ``--strategy auto`` the planner
picks the strategy and the micro-batch whose process peak fits ``--memory-budget-mib`` (torch and its
heap included: about 0.6 GB on a CPU) from one step's batch (unless
``--grad-accum`` fixes the micro-batch). The synthetic text has structure (every other token follows from the one
before), so the loss falls from ~ln(vocab) towards ~ln(vocab)/2.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import dspark
from dspark import comm
from dspark.engine import PRECISIONS
from dspark.models import GPT, GPTConfig, synthetic_tokens
from dspark.policy import all_strategies


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="replicate", choices=[*all_strategies(), "auto"],
                        help="hybrid-zero1/2/3: the stage inside each node's ranks, replicas across nodes")
    parser.add_argument("--memory-budget-mib", type=float, default=None,
                        help="--strategy auto: MiB per rank to fit in (default: the device's memory)")
    parser.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step, all ranks")
    parser.add_argument("--grad-accum", type=int, default=None,
                        help="micro-steps per optimizer step (default 1, or auto's choice)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    world = dspark.init()
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # one worker = one core
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, context_len=args.seq_len, num_layers=args.layers,
                       num_heads=4, width=args.width)
    def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:   # logits (B, T, vocab)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:   # this rank's rows of the step
        tokens, targets = synthetic_tokens(args.global_batch, seq_len=args.seq_len,
                                           vocab_size=args.vocab, seed=step, device=world.device)
        return dspark.distribute_batch((tokens, targets), shard_dim=0)

    auto = args.strategy == "auto"
    engine = dspark.Engine(GPT(config), optimizer=functools.partial(torch.optim.AdamW, lr=args.lr),
                           strategy=args.strategy, precision=args.precision,
                           grad_accum_steps=args.grad_accum, clip_grad_norm=args.clip,
                           memory_budget=int(args.memory_budget_mib * 2**20) if args.memory_budget_mib else None,
                           sample_batch=step_batch(0) if auto else None, loss_fn=token_loss if auto else None)
    if world.is_main and auto:
        print(f"auto chose {engine.strategy.name}, micro-batch {engine.micro_batch} x "
              f"{engine.grad_accum_steps} per rank", flush=True)
    losses = []
    for step in range(args.steps):
        started = time.perf_counter()
        step_loss = torch.zeros((), device=world.device)
        for x, y in engine.micro_batches(step_batch(step)):   # grad_accum_steps equal parts
            loss = token_loss(engine(x), y)
            engine.backward(loss)
            step_loss += loss.detach() / engine.grad_accum_steps
        applied = engine.step()
        comm.all_reduce(step_loss, op="avg")  # the loss of the whole global batch
        losses.append(float(step_loss))
        if world.is_main and (step % args.log_every == 0 or step == args.steps - 1):
            ms = (time.perf_counter() - started) * 1e3
            note = "" if applied else "  (fp16 overflow: step skipped)"
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {ms:6.1f} ms{note}", flush=True)
    report = engine.memory_report()
    if world.is_main:
        print(f"{world.world_size} rank(s), {engine.strategy.name}, {args.precision}: loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f}; model state on rank 0: {int(report['total_bytes']) / 2**20:.2f} MiB "
              f"(strategy needs {int(report['total_bytes_expected']) / 2**20:.2f} MiB)", flush=True)
    del engine
    dspark.shutdown()


if __name__ == "__main__":
    main()
