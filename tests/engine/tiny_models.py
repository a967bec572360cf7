"""Small models for engine tests: uneven row counts, a tied weight, a parameter that gets no gradient."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 6, hidden: int = 7, d_out: int = 3) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                                    nn.Tanh(), nn.Linear(hidden, d_out))
        self.scale = nn.Parameter(torch.tensor(1.5))  # a 0-d parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale


class TiedLM(nn.Module):
    """Embedding and output head share one weight; ``unused`` never gets a gradient."""

    def __init__(self, vocab: int = 11, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.unused = nn.Linear(3, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(self.norm(h))


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": TinyMLP, "tied": TiedLM}[name]()


def batch(name: str, global_batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    if name == "mlp":
        return torch.randn(global_batch, 6, generator=g), torch.randn(global_batch, 3, generator=g)
    tokens = torch.randint(0, 11, (global_batch, 5), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return torch.nn.functional.mse_loss(out.float(), target)
    return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), target.flatten())
