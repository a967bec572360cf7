"""A small GPT trained the way nanoGPT's train.py trains one, on DSpark, with tiny CPU-sized defaults:
a warm-up and cosine learning rate, gradient accumulation, clipping, a regular evaluation of the
train and validation loss, a checkpoint that resumes at any world size (docs/porting.md).

    dspark run --nproc 2 examples/nanogpt_port.py    # then at any --nproc: --init_from resume
"""

import argparse
import functools
import itertools
import math
import os
import time

import torch
from nanogpt_model import GPT, GPTConfig, Windows, tokens

import dspark

defaults = dict(out_dir="out-nanogpt", eval_interval=10, log_interval=1, eval_iters=2, max_iters=30,
                gradient_accumulation_steps=4, batch_size=4, block_size=64, learning_rate=1e-3,
                weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, warmup_iters=5,
                lr_decay_iters=30, min_lr=1e-4, dtype="bf16", wandb_log=0, init_from="scratch")
parser = argparse.ArgumentParser(description=__doc__)
for key, value in defaults.items():
    parser.add_argument(f"--{key}", type=type(value), default=value)
args = parser.parse_args()

world = dspark.init()  # rank, world size, device from `dspark run` (one process without it)
if args.gradient_accumulation_steps % world.world_size:
    raise SystemExit(f"--gradient_accumulation_steps={args.gradient_accumulation_steps} must divide by the "
                     f"world size {world.world_size}: it counts the micro-batches of a step over all ranks")
accum = args.gradient_accumulation_steps // world.world_size  # this rank's micro-batches per step
step_rows = args.batch_size * args.gradient_accumulation_steps  # one step's samples, at any world size
dspark.print(f"tokens per step: {step_rows * args.block_size:,}")
if world.is_main:
    os.makedirs(args.out_dir, exist_ok=True)
torch.manual_seed(1337)  # the engine starts every rank from rank 0's weights anyway

# the text: 90% to train on, 10% to validate on; a sample is a window of block_size tokens
data = tokens()
train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
train_loader = dspark.DataLoader(Windows(train_data, args.block_size), global_batch_size=step_rows, seed=1337)
# evaluation reads the same windows at every evaluation and at any world size: eval_iters steps' worth
# of evenly spaced windows, one whole pass each time, every rank evaluating its rows of each batch
eval_sets = {split: torch.utils.data.Subset(
                 windows, torch.linspace(0, len(windows) - 1, args.eval_iters * step_rows).long().tolist())
             for split, windows in (("train", Windows(train_data, args.block_size)),
                                    ("val", Windows(val_data, args.block_size)))}
eval_loaders = {split: dspark.DataLoader(subset, global_batch_size=step_rows, shuffle=False)
                for split, subset in eval_sets.items()}
micro_batches = (micro for batch in itertools.chain.from_iterable(itertools.repeat(train_loader))  # epoch after epoch
                 for micro in zip(*(t.chunk(accum) for t in batch), strict=True))


def get_batch():
    x, y = next(micro_batches)  # this rank's next micro-batch: its rows of a step's global batch, cut in `accum`
    return x.to(world.device), y.to(world.device)


model = GPT(GPTConfig(block_size=args.block_size))
optimizer = functools.partial(torch.optim.AdamW, lr=args.learning_rate, betas=(args.beta1, args.beta2),
                              weight_decay=args.weight_decay)
model = dspark.Engine(model, optimizer=optimizer,
                      param_groups=lambda name, p: {} if p.dim() >= 2 else {"weight_decay": 0.0},
                      precision=args.dtype, clip_grad_norm=args.grad_clip or None, grad_accum_steps=accum)
extra = {"train_loader": train_loader, "best": {"val_loss": 1e9}}  # restored in place by model.load
iter_num = 0
if args.init_from == "resume":  # written at any world size, by any strategy
    iter_num = model.load(os.path.join(args.out_dir, "ckpt"), extra=extra).step_count


@torch.no_grad()
def estimate_loss():
    """The mean loss over each evaluation set, the same at any world size (every rank runs it)."""
    model.eval()
    out = {}
    for split, loader in eval_loaders.items():
        loss_sum, rows = 0.0, 0
        for x_rows, y_rows in loader:  # this rank's rows of each global batch, in micro-batches
            for x, y in zip(x_rows.split(args.batch_size), y_rows.split(args.batch_size), strict=True):
                _, loss = model(x.to(world.device), y.to(world.device))
                loss_sum, rows = loss_sum + float(loss) * len(x), rows + len(x)
        out[split] = dspark.reduce_metrics({"loss": loss_sum / max(rows, 1)}, weight=rows)["loss"]  # over all ranks
    model.train()
    return out


def get_lr(it):  # linear warm-up, then a cosine down to min_lr
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    progress = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.learning_rate - args.min_lr)


tracker = dspark.Tracker(args.out_dir, backends=("tensorboard", "wandb")[: 1 + args.wandb_log], project="nanogpt")

t0 = time.time()
while True:
    lr = get_lr(iter_num)
    for group in model.optimizer.param_groups:  # every rank: the ranks' hyper-parameters are compared each step
        group["lr"] = lr
    if iter_num % args.eval_interval == 0:  # every rank: each evaluates its rows, reduce_metrics combines them
        losses = estimate_loss()
        dspark.print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        tracker.log({"train/loss": losses["train"], "val/loss": losses["val"], "lr": lr}, step=iter_num)
        extra["best"]["val_loss"] = min(extra["best"]["val_loss"], float(losses["val"]))
        if iter_num > 0:
            dspark.print(f"saving checkpoint to {args.out_dir}")
            model.save(os.path.join(args.out_dir, "ckpt"), extra=extra)  # every rank writes its shards
    for _ in range(accum):  # this rank's micro-batches of the step
        X, Y = get_batch()  # taken right before use: a checkpoint holds the loader's exact position
        logits, loss = model(X, Y)
        model.backward(loss)  # the micro-batch's mean loss: the engine averages the step's micro-batches
    model.step()  # gradients reduced during the last backward; clipping and the update here
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % args.log_interval == 0:
        dspark.print(f"iter {iter_num}: loss {float(loss):.4f} (rank 0's last micro-batch), time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > args.max_iters:
        break
tracker.close()
dspark.shutdown()
