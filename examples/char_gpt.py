"""Train a character-level GPT on the Python standard library's own source code, on 1..N devices.

    dspark run --nproc 2 examples/char_gpt.py --out runs/char_gpt
    dspark run --nproc 1 examples/char_gpt.py --out runs/char_gpt_1    # same run, one device

The text is every top-level ``*.py`` file of this interpreter's standard library (found through
``sysconfig``, so it exists wherever Python does). Every tenth file, in name order, is held out for
validation: the validation loss is measured on modules the model never saw. ``dspark.DataLoader``
gives each rank its rows of every global batch of windows, so 1 and 2 devices train on exactly the
same global batches and follow the same loss curve, 2 devices in about half the time.

The optimizer is nanoGPT's: AdamW with weight decay on the matrices and embeddings only (the engine's
``param_groups=``), and a linear warm-up then cosine decay of the learning rate (a
``torch.optim.lr_scheduler.LambdaLR`` on ``engine.optimizer``). Every ``--save-every`` steps
``engine.save(..., extra=...)`` writes a checkpoint of the weights, the optimizer, the loader's
position, the scheduler and the curves; run the same command again, at any ``--nproc``, and it
resumes where it stopped, on exactly the samples the uninterrupted run would have seen.
``--stop-after N`` stops at step N as a preempted job would (the schedule still spans ``--steps``).
The curves go to ``<out>/char_gpt.png``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sysconfig
import time
from pathlib import Path

import _support as support
import numpy as np
import torch
from torch.utils.data import Dataset

import dspark
from dspark.models import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/char_gpt"),
                        help="checkpoints and the PNG of the curves")
    parser.add_argument("--steps", type=int, default=600,
                        help="train until this many steps (the learning-rate schedule's length)")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="save and stop at this step, as a preempted job would; run again to resume")
    parser.add_argument("--global-batch", type=int, default=32, help="windows per step, all ranks")
    parser.add_argument("--seq-len", type=int, default=128, help="characters per window")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--weight-decay", type=float, default=0.1,
                        help="AdamW's, on matrices and embeddings (not on biases and norms)")
    parser.add_argument("--max-chars", type=int, default=2_000_000,
                        help="characters of training text (validation: a tenth of it)")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-windows", type=int, default=256, help="validation windows per eval")
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--strategy", default="replicate", choices=["replicate", "zero1", "zero2", "zero3"])
    parser.add_argument("--sample-chars", type=int, default=300, help="text to generate at the end")
    return parser.parse_args()


def stdlib_sources(max_chars: int) -> tuple[str, str]:
    """(training text, validation text): the standard library's top-level modules, every tenth file
    held out for validation, each part cut at its share of ``max_chars``."""
    root = Path(sysconfig.get_path("stdlib") or "")
    if not root.is_dir():  # an unusual install: the folder that holds a stdlib module
        root = Path(inspect.getfile(argparse)).parent
    files = sorted(root.glob("*.py"))
    if len(files) < 20:
        raise SystemExit(f"found only {len(files)} standard library files in {root}")
    train: list[str] = []
    val: list[str] = []
    for i, path in enumerate(files):
        (val if i % 10 == 0 else train).append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(train)[:max_chars], "\n".join(val)[: max_chars // 10]


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``seq_len`` characters; the target is the window shifted by one."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids = ids
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]  # (T,), (T,)


def encode(train_text: str, val_text: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Character ids (int64) of both texts, and the vocabulary (id -> character)."""
    codes = np.frombuffer((train_text + val_text).encode("utf-32-le"), dtype=np.uint32)
    vocab, inverse = np.unique(codes, return_inverse=True)
    ids = torch.from_numpy(inverse.astype(np.int64))
    return ids[: len(train_text)], ids[len(train_text):], [chr(c) for c in vocab]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, V), (B*T,)


def validation_loss(engine: dspark.Engine, val_loader: dspark.DataLoader) -> float:
    def measure(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.stack([token_loss(logits, targets) * len(targets), torch.tensor(float(len(targets)))])

    loss_sum, windows = support.evaluate(engine, val_loader, measure)
    return loss_sum / windows


@torch.no_grad()
def sample(engine: dspark.Engine, vocab: list[str], prompt: str, num_chars: int, seq_len: int) -> str:
    """Generate text from ``prompt`` (every rank runs the same forwards, so zero3 works too)."""
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = [lookup.get(c, 0) for c in prompt]
    generator = torch.Generator().manual_seed(0)
    engine.module.eval()
    for _ in range(num_chars):
        logits = engine(torch.tensor([ids[-seq_len:]]))[0, -1]  # (V,)
        probs = torch.softmax(logits.float() / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    engine.module.train()
    return "".join(vocab[i] for i in ids)


def main() -> None:
    args = parse_args()
    world = dspark.init()
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # one worker = one core
    train_ids, val_ids, vocab = encode(*stdlib_sources(args.max_chars))
    train_set, val_set = CharWindows(train_ids, args.seq_len), CharWindows(val_ids, args.seq_len)
    # the same validation windows at every evaluation: evenly spaced over the held-out modules
    val_subset = torch.utils.data.Subset(
        val_set, torch.linspace(0, len(val_set) - 1, min(args.eval_windows, len(val_set))).long().tolist())
    loader = dspark.DataLoader(train_set, global_batch_size=args.global_batch, shuffle=True, seed=0)
    val_loader = dspark.DataLoader(val_subset, global_batch_size=args.global_batch, shuffle=False,
                                   drop_last=True)

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=len(vocab), context_len=args.seq_len, num_layers=args.layers,
                          num_heads=args.heads, width=args.width))
    optimizer = functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    engine = dspark.Engine(model, optimizer=optimizer, strategy=args.strategy, clip_grad_norm=1.0,
                           param_groups=support.no_decay_for_biases_and_norms)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, functools.partial(
        support.warmup_cosine, warmup_steps=args.warmup_steps, total_steps=args.steps))
    curves = support.Curves()
    state = {"loader": loader, "scheduler": scheduler, "curves": curves}
    latest = support.latest_checkpoint(args.out)
    if latest is not None:
        engine.load(latest, extra=state)
    if world.is_main:
        print(f"char_gpt: {len(train_set)} training windows of {args.seq_len} characters "
              f"({len(train_ids):,} characters, vocabulary {len(vocab)}), {len(val_subset)} validation "
              f"windows; {world.world_size} rank(s), {args.global_batch // world.world_size} windows each "
              f"per step; " + (f"resumed from {latest.name}" if latest else "starting at step 0"), flush=True)

    last_step = min(args.steps, args.stop_after or args.steps)
    batches = iter(loader)
    start = time.perf_counter()
    while engine.step_count < last_step:
        try:
            x, y = next(batches)
        except StopIteration:  # an epoch ended: the next pass reshuffles by itself
            batches = iter(loader)
            continue
        loss = token_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        scheduler.step()
        step = engine.step_count
        curves.add("train loss", step, support.global_mean(loss))  # the global batch's, not this rank's
        if step % args.eval_every == 0 or step == args.steps:
            curves.add("validation loss", step, validation_loss(engine, val_loader))
            if world.is_main:
                print(f"step {step}: train loss {curves.last('train loss'):.3f}, validation loss "
                      f"{curves.last('validation loss'):.3f} (epoch {loader.epoch})", flush=True)
        if step % args.save_every == 0 or step == last_step:
            curves.train_s += time.perf_counter() - start
            start = time.perf_counter()
            support.save_checkpoint(engine, args.out, state)

    curves.plot(args.out / "char_gpt.png", f"char-level GPT on the Python standard library, "
                f"{world.world_size} rank(s)", [["train loss", "validation loss"]])
    text = sample(engine, vocab, "def ", args.sample_chars, args.seq_len) if args.sample_chars else ""
    checksum = sum(float(t.double().sum()) for t in engine.full_state_dict().values())  # collective
    if world.is_main:
        evaluated = curves.series.get("validation loss")
        val = f"validation loss {evaluated[-1][1]:.4f}" if evaluated else "not evaluated yet"
        print(f"{text}\nchar_gpt: {world.world_size} rank(s), step {engine.step_count}, {val}, "
              f"training time {curves.train_s:.1f} s, weights checksum {checksum:.8f}, "
              f"curves in {args.out / 'char_gpt.png'}", flush=True)
        if engine.step_count < args.steps:
            print(f"char_gpt: stopped at step {engine.step_count} of {args.steps}; run it again without "
                  f"--stop-after to resume", flush=True)
    engine.close()
    dspark.shutdown()


if __name__ == "__main__":
    main()
