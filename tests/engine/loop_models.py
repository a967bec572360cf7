"""Models and single-process references for the training-loop tests: a nanoGPT-shaped model whose every
module initialises itself in ``reset_parameters`` (so it can be built on the meta device), and plain
PyTorch training to compare against."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB, WIDTH, SEQ = 13, 8, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(torch.tanh(self.fc(self.norm(h))))


class Scale(nn.Module):
    """A module with its own 0-d parameter and its own reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gain, 0.5, 1.5)


class LoopGPT(nn.Module):
    """Embedding, three blocks, a final norm, a tied head; a frozen positional table."""

    def __init__(self, blocks: int = 3, frozen_positions: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.pos.weight.requires_grad_(not frozen_positions)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.norm = nn.LayerNorm(WIDTH)
        self.scale = Scale()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)) * self.scale.gain


def build(seed: int = 0, device: str = "cpu", **kwargs: Any) -> LoopGPT:
    torch.manual_seed(seed)
    with torch.device(device):
        return LoopGPT(**kwargs)


def batch(step: int, global_batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def nanogpt_groups(name: str, param: nn.Parameter) -> dict[str, float]:
    """nanoGPT's rule: weight decay for matrices and embeddings, none for biases and norms."""
    return {} if param.ndim >= 2 else {"weight_decay": 0.0}


def warmup_cosine(step: int, warmup: int = 2, total: int = 6) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def reference(steps: int, opt: Callable[..., torch.optim.Optimizer], *, groups: bool = False,
              schedule: bool = False, micro_batches: list[int] | None = None,
              model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, the whole batch of every step (split into ``micro_batches``
    chunks, the loss of each averaged over the chunks, when given)."""
    model = model or build()
    params = [p for p in _unique(model) if p.requires_grad]
    if groups:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decay = [p for _, p in named if p.ndim >= 2]
        no_decay = [p for _, p in named if p.ndim < 2]
        optimizer = opt([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    else:
        optimizer = opt(params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine) if schedule else None
    for step in range(steps):
        x, y = batch(step)
        chunks = micro_batches or [x.shape[0]]
        optimizer.zero_grad()
        offset = 0
        for size in chunks:
            loss = loss_fn(model(x[offset: offset + size]), y[offset: offset + size]) / len(chunks)
            loss.backward()
            offset += size
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unique(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def max_rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], floor: float = 1e-6) -> float:
    """The largest ``||a - b|| / max(||b||, floor)`` over the tensors of two state dicts."""
    if a.keys() != b.keys():
        raise AssertionError(f"state dict keys differ: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[k].double() - b[k].double()).norm() / max(float(b[k].double().norm()), floor))
               for k in b)
