"""Small models for engine tests: uneven row counts, a tied weight, a parameter that gets no gradient."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


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


# -- models as users bring them (issue 7): each one exercises something DSpark's own models do not --


class ConvNet(nn.Module):
    """A small image classifier (N, 3, 6, 6) -> (N, 4); ``batchnorm=True`` puts a BatchNorm2d after each
    convolution (running statistics, and a forward that depends on the batch in training mode)."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()

        def norm(channels: int) -> nn.Module:
            return nn.BatchNorm2d(channels) if batchnorm else nn.Identity()

        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), norm(6), nn.ReLU(),
                                      nn.Conv2d(6, 8, 3, stride=2, padding=1), norm(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(dim=(2, 3)))  # (N, 8, 3, 3) -> (N, 8) -> (N, 4)


class MixedDtypeMLP(nn.Module):
    """An fp32 branch and a bf16 branch side by side (as when a user keeps part of a model in another
    dtype): (N, 6) -> (N, 6), the fp32 branch's 3 outputs then the bf16 branch's. With a loss that
    weighs the two halves separately, each fp32 gradient is a sum of fp32 terms whatever the batch
    split, so fp32 parity stays exact to rounding. The last registered parameter is bf16: a bucket
    filled in backward order starts with a bf16 gradient and then holds fp32 ones. No container: zero3
    gathers all four layers as one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)
        self.low1 = nn.Linear(6, 8).to(torch.bfloat16)
        self.low2 = nn.Linear(8, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        high = self.fc2(torch.tanh(self.fc1(x)))
        low = self.low2(torch.tanh(self.low1(x.bfloat16())))
        return torch.cat([high, low.float()], dim=1)


class RepeatedBlockNet(nn.Module):
    """``blocks[0]`` runs twice in every forward (weight sharing across depth, as ALBERT or a
    recurrent cell do); ``checkpoint`` wraps every block call in ``torch.utils.checkpoint``."""

    def __init__(self, checkpoint: str = "none") -> None:
        super().__init__()
        if checkpoint not in ("none", "reentrant", "non_reentrant"):
            raise ValueError(f"checkpoint={checkpoint!r}")
        self.checkpoint = checkpoint
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in (self.blocks[0], self.blocks[1], self.blocks[0]):
            if self.checkpoint == "none" or not torch.is_grad_enabled():  # nothing to save in eval
                h = h + torch.tanh(block(h))
            else:
                h = h + torch.tanh(checkpoint(block, h, use_reentrant=self.checkpoint == "reentrant"))
        return self.head(h)


class _CheckpointedBlock(nn.Module):
    def __init__(self, width: int, inner: str) -> None:
        super().__init__()
        self.inner = inner
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.inner == "none" or not torch.is_grad_enabled():
            return h + self._mlp(self.norm(h))
        return h + checkpoint(self._mlp, self.norm(h), use_reentrant=self.inner == "reentrant")


class CheckpointedNet(nn.Module):
    """Activation checkpointing as users write it: ``where="inside"`` checkpoints part of each block from
    the block's own forward; ``where="unit"`` checkpoints whole blocks from the parent (under zero3 the
    recomputation re-enters the block's gather hooks during backward). ``reentrant`` picks
    ``use_reentrant``."""

    def __init__(self, where: str, reentrant: bool) -> None:
        super().__init__()
        if where not in ("inside", "unit"):
            raise ValueError(f"where={where!r}")
        self.where = where
        self.reentrant = reentrant
        mode = ("reentrant" if reentrant else "non_reentrant") if where == "inside" else "none"
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([_CheckpointedBlock(8, mode) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            if self.where == "unit" and torch.is_grad_enabled():
                h = checkpoint(block, h, use_reentrant=self.reentrant)
            else:
                h = block(h)
        return self.head(h)
