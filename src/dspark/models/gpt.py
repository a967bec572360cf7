"""GPT-2 style decoder-only transformer (nanoGPT layout), parametrised so a CPU preset reuses it.

Token + learned position embeddings, ``num_layers`` pre-LayerNorm blocks (causal self-attention
through ``F.scaled_dot_product_attention``, then a GELU MLP four times as wide), a final LayerNorm and an
``lm_head`` whose weight *is* the token embedding (tied: one tensor, counted once). Linear and
LayerNorm layers carry biases, as in the released GPT-2.

With the defaults (12 layers, 12 heads, width 768, context 1024, vocabulary 50257) it has exactly
124,439,808 parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of a GPT-2 style model."""

    vocab_size: int = 50257
    """Token ids are in [0, vocab_size)."""
    context_len: int = 1024
    """Longest sequence (rows of the position embedding)."""
    num_layers: int = 12
    """Transformer blocks."""
    num_heads: int = 12
    """Attention heads per block; must divide width."""
    width: int = 768
    """Embedding / residual stream width (``n_embd``)."""
    dropout: float = 0.0
    """Dropout probability; 0 for benchmarks (deterministic, and no mask cost)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "num_layers", "num_heads", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.width % self.num_heads:
            raise ValueError(f"width={self.width!r} does not divide by num_heads="
                             f"{self.num_heads!r}; choose num_heads among the divisors of width")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.proj = nn.Linear(4 * config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``token ids (B, T) int64 -> logits (B, T, vocab_size)``.

    Example::

        model = GPT(GPTConfig())                             # GPT-2 124M, 124,439,808 parameters
        logits = model(torch.randint(0, 50257, (2, 16)))     # (2, 16, 50257)
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.width)
        self.wpe = nn.Embedding(config.context_len, config.width)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        # Tied: the output projection is the token embedding itself (one Parameter, two uses).
        # parameters() deduplicates it, so it is counted, all-reduced and stepped once.
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
        # GPT-2's scaled init: each block adds two projections to the residual stream, so their
        # std shrinks with depth to keep the stream's variance from growing with num_layers.
        std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for module in self.modules():
            if isinstance(module, (CausalSelfAttention, MLP)):
                nn.init.normal_(module.proj.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]  # tokens: (B, T)
        if T > self.config.context_len:
            raise ValueError(f"sequence length {T} exceeds context_len="
                             f"{self.config.context_len}; pass at most that many tokens")
        positions = torch.arange(T, device=tokens.device)                    # (T,)
        x = self.drop(self.wte(tokens) + self.wpe(positions))                 # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))                                     # (B, T, vocab)
