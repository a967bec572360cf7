"""nanoGPT's train.py, condensed, with tiny CPU-sized defaults. examples/nanogpt_ddp_original.py is
the PyTorch DDP original, examples/nanogpt_port.py its DSpark port (docs/porting.md); diff them.

    torchrun --standalone --nproc_per_node=2 examples/nanogpt_ddp_original.py
"""

import argparse
import math
import os
import time
from contextlib import nullcontext

import torch
from nanogpt_model import GPT, GPTConfig, tokens
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

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
ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
if ddp:
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}" if torch.cuda.is_available() else "cpu"
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    seed_offset = ddp_rank  # each process gets a different seed
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
assert gradient_accumulation_steps % ddp_world_size == 0
gradient_accumulation_steps //= ddp_world_size  # micro-batches per rank and step
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * args.batch_size * args.block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    os.makedirs(args.out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
ctx = nullcontext() if args.dtype == "fp32" else torch.autocast(device_type=device_type, dtype=ptdtype)

# data: 90% train, 10% val, random windows
data = tokens()
train_data, val_data = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([data[i: i + args.block_size].long() for i in ix])
    y = torch.stack([data[i + 1: i + 1 + args.block_size].long() for i in ix])
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model = GPT(GPTConfig(block_size=args.block_size))
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(args.dtype == "fp16"))
optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, (args.beta1, args.beta2), device_type)
if args.init_from == "resume":
    checkpoint = torch.load(os.path.join(args.out_dir, "ckpt.pt"), map_location=device)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == "cuda" else None)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            with ctx:
                _, loss = model(X, Y)
            losses[k] = loss.item()
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


if args.wandb_log and master_process:
    import wandb
    wandb.init(project="nanogpt", config=vars(args))

X, Y = get_batch("train")  # fetch the very first batch
t0 = time.time()
raw_model = model.module if ddp else model
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % args.eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if args.wandb_log:
            wandb.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr})
        if losses["val"] < best_val_loss or iter_num > 0:
            best_val_loss = min(best_val_loss, losses["val"])
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "iter_num": iter_num, "best_val_loss": best_val_loss}
                print(f"saving checkpoint to {args.out_dir}")
                torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))
    # forward backward update, with optional gradient accumulation to simulate larger batch size
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # only sync gradients at the last micro step
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
        X, Y = get_batch("train")  # immediately async prefetch next batch
        scaler.scale(loss).backward()
    if args.grad_clip != 0.0:  # clip the gradient
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % args.log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps  # an estimate of the total loss
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    if iter_num > args.max_iters:
        break
if ddp:
    destroy_process_group()
