"""nanoGPT's train.py, condensed, with tiny CPU-sized defaults. examples/nanogpt_ddp_original.py is
the PyTorch DDP original, examples/nanogpt_port.py its DSpark port (docs/porting.md); diff them.

    dspark run --nproc 2 examples/nanogpt_port.py    # then at any --nproc: --init_from resume
"""

import argparse
import functools
import itertools
import math
import os
import time
from contextlib import nullcontext

import torch
from nanogpt_model import GPT, GPTConfig, Windows, tokens

import dspark

defaults = dict(out_dir="out-nanogpt", eval_interval=10, log_interval=1, eval_iters=4, max_iters=30,
                gradient_accumulation_steps=4, batch_size=4, block_size=64, learning_rate=1e-3,
                weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, warmup_iters=5,
                lr_decay_iters=30, min_lr=1e-4, dtype="bf16", wandb_log=0, init_from="scratch")
parser = argparse.ArgumentParser(description=__doc__)
for key, value in defaults.items():
    parser.add_argument(f"--{key}", type=type(value), default=value)
args = parser.parse_args()
gradient_accumulation_steps = args.gradient_accumulation_steps

# various inits, derived attributes, I/O setup
world = dspark.init()  # rank, world size, device from `dspark run` (one process without it)
master_process, seed_offset, ddp_world_size, device = world.rank == 0, world.rank, world.world_size, str(world.device)
assert gradient_accumulation_steps % ddp_world_size == 0
gradient_accumulation_steps //= ddp_world_size  # micro-batches per rank and step
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * args.batch_size * args.block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(args.out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ctx = nullcontext()  # engine(x) runs under Engine(precision=...) itself

# data: 90% train, 10% val, random windows
data = tokens()
train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
loaders = {split: dspark.DataLoader(Windows(data, args.block_size), seed=1337,  # a global batch: one step, at any world size
                                    global_batch_size=args.batch_size * gradient_accumulation_steps * ddp_world_size)
           for split, data in (("train", train_data), ("val", val_data), ("train_eval", train_data))}
streams = {split: (micro for batch in itertools.chain.from_iterable(itertools.repeat(loader))  # epoch after epoch
                   for micro in zip(*(t.chunk(gradient_accumulation_steps) for t in batch), strict=True)) for split, loader in loaders.items()}


def get_batch(split):
    x, y = next(streams[split])  # this rank's next micro-batch: its rows of a step's global batch, cut in K
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model = GPT(GPTConfig(block_size=args.block_size))
model.to(device)
optimizer = functools.partial(torch.optim.AdamW, lr=args.learning_rate, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay)
model = dspark.Engine(model, optimizer=optimizer, param_groups=lambda name, p: {} if p.dim() >= 2 else {"weight_decay": 0.0},
                      precision=args.dtype, clip_grad_norm=args.grad_clip or None, grad_accum_steps=gradient_accumulation_steps)
optimizer, extra = model.optimizer, {**loaders, "best": {"val_loss": best_val_loss}}  # restored in place
if args.init_from == "resume":  # written at any world size, by any strategy
    iter_num = model.load(os.path.join(args.out_dir, "ckpt"), extra=extra).step_count
    best_val_loss = extra["best"]["val_loss"]


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split if split == "val" else "train_eval")  # training's own stream goes on
            with ctx:
                _, loss = model(X, Y)
            losses[k] = dspark.reduce_metrics({"loss": loss}, weight=len(X))["loss"]  # all ranks' rows
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):  # linear warm-up, then cosine decay to min_lr
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    if it > args.lr_decay_iters:
        return args.min_lr
    decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


tracker = dspark.Tracker(args.out_dir, backends=("tensorboard", "wandb")[: 1 + args.wandb_log], project="nanogpt")

t0 = time.time()
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % args.eval_interval == 0:  # on every rank: the engine's forward is collective
        losses = estimate_loss()
        dspark.print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        tracker.log({"train/loss": losses["train"], "val/loss": losses["val"], "lr": lr}, step=iter_num)
        if losses["val"] < best_val_loss or iter_num > 0:
            best_val_loss = min(best_val_loss, losses["val"])
            if iter_num > 0:
                extra["best"]["val_loss"] = float(best_val_loss)
                dspark.print(f"saving checkpoint to {args.out_dir}")
                model.save(os.path.join(args.out_dir, "ckpt"), extra=extra)  # every rank writes its shards
    # forward backward update, with optional gradient accumulation to simulate larger batch size
    for _ in range(gradient_accumulation_steps):  # this rank's K micro-batches of the step
        X, Y = get_batch("train")  # no prefetch: a checkpoint holds the loader's exact position
        with ctx:
            logits, loss = model(X, Y)
        model.backward(loss)  # the micro-batch's mean loss: the engine averages the window (no / K)
    model.step()  # gradients reduced during the last backward; clipping and the update here
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % args.log_interval == 0 and master_process:
        lossf = loss.item()  # rank 0's last micro-batch
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > args.max_iters:
        break
tracker.close()
dspark.shutdown()
