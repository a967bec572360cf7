"""Models the planner was never tuned for, each driven by a different part of memory: the zoo that
``benchmarks/plan_validation.py`` and ``tests/planner`` hold the plan to.

Each entry builds ``(model, global batch, loss_fn)`` at two sizes: ``"bench"`` (tens of MB of
tensors: what the benchmark measures, large enough that a missed buffer shows) and ``"tiny"``
(what the test suite runs on its rank pool, within its budget). Global batches divide by 1, 2 and 3
ranks. ``loss_fn`` is None where the model returns its loss (HuggingFace models given labels).

Example::

    from dspark.models.plan_zoo import ZOO, build
    model, batch, loss_fn = build("embed-tied", size="tiny", seed=0)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SIZES", "ZOO", "ZooModel", "build", "classify_loss", "token_loss"]

SIZES = ("tiny", "bench")


def classify_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over ``(batch, classes)`` logits."""
    return F.cross_entropy(logits.float(), targets)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over ``(batch, tokens, vocabulary)`` logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _mlp(width: int, depth: int, inputs: int, classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class EmbeddingEncoder(nn.Module):
    """A token embedding, a few encoder layers and a vocabulary head, tied to the embedding or not."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, *, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class ConvBN(nn.Module):
    """Three conv blocks with BatchNorm, pooled, and a linear classifier."""

    def __init__(self, width: int, classes: int = 10) -> None:
        super().__init__()
        chans = [3, width, 2 * width, 4 * width]
        blocks: list[nn.Module] = []
        for cin, cout in itertools.pairwise(chans):
            blocks += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                       nn.MaxPool2d(2)]
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Linear(chans[-1], classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).mean(dim=(2, 3)))


class FrozenBackbone(nn.Module):
    """An embedding and the first half of an MLP frozen (no gradient, no optimizer state), a
    trainable second half: the model state of a fine-tune."""

    def __init__(self, vocab: int, dim: int, depth: int, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.frozen = _mlp(dim, depth, dim, dim)
        self.trained = _mlp(dim, depth, dim, classes)
        for p in [*self.embed.parameters(), *self.frozen.parameters()]:
            p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.trained(torch.relu(self.frozen(self.embed(tokens))))


class MixedDtypes(nn.Module):
    """A bfloat16 embedding (as a model loaded in half precision keeps it) in front of float32
    layers: parameters of two dtypes, reduced in two dtypes' buckets."""

    def __init__(self, vocab: int, dim: int, depth: int, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim).to(torch.bfloat16)
        self.body = _mlp(dim, depth, dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens).float().mean(dim=1))


def _tokens(rows: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _classes(rows: int, seed: int, classes: int = 10) -> torch.Tensor:
    return torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(seed + 1))


def _hf(kind: str, vocab: int, dim: int, layers: int, length: int) -> nn.Module:
    from transformers.utils import logging

    logging.set_verbosity_error()
    if kind == "bert":
        from transformers import BertConfig, BertForMaskedLM
        return BertForMaskedLM(BertConfig(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
                                          num_attention_heads=4, intermediate_size=4 * dim,
                                          max_position_embeddings=length, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=length, n_embd=dim, n_layer=layers,
                                          n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=3 * dim,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=length, tie_word_embeddings=False))


Builder = Callable[[bool, int], tuple[nn.Module, Any, Callable[..., torch.Tensor] | None]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ZooModel:
    """One zoo entry: what drives its memory, and how to build it at each size."""

    name: str
    drives: str
    """What dominates this model's memory (why it is in the zoo)."""
    build: Builder
    """``build(tiny, seed) -> (model, global batch, loss_fn or None)``."""


def _deep(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
    width, depth, rows = (64, 12, 12) if tiny else (256, 48, 48)
    return _mlp(width, depth, width, 10), (torch.randn(rows, width), _classes(rows, seed)), classify_loss


def _wide(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
    width, rows = (512, 12) if tiny else (3072, 48)
    return _mlp(width, 2, 256, 10), (torch.randn(rows, 256), _classes(rows, seed)), classify_loss


def _embed(tied: bool) -> Builder:
    def build(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
        vocab, dim, length, rows = (2000, 64, 16, 6) if tiny else (32000, 256, 32, 12)
        tokens = _tokens(rows, length + 1, vocab, seed)
        return (EmbeddingEncoder(vocab, dim, 2, 4, tied=tied), (tokens[:, :-1], tokens[:, 1:]), token_loss)
    return build


def _conv(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
    width, side, rows = (8, 16, 12) if tiny else (32, 32, 48)
    return ConvBN(width), (torch.randn(rows, 3, side, side), _classes(rows, seed)), classify_loss


def _long(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
    vocab, dim, length, rows = (256, 32, 128, 6) if tiny else (512, 128, 1024, 6)
    tokens = _tokens(rows, length + 1, vocab, seed)
    return EmbeddingEncoder(vocab, dim, 2, 4, tied=False), (tokens[:, :-1], tokens[:, 1:]), token_loss


def _hf_builder(kind: str) -> Builder:
    def build(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
        vocab, dim, layers, length, rows = (512, 64, 2, 32, 6) if tiny else (8192, 256, 4, 128, 12)
        model = _hf(kind, vocab, dim, layers, length)
        tokens = _tokens(rows, length, vocab, seed)
        return model, {"input_ids": tokens, "labels": tokens}, None
    return build


def _frozen(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
    vocab, dim, depth, rows = (1000, 64, 3, 12) if tiny else (50000, 512, 6, 48)
    return (FrozenBackbone(vocab, dim, depth), (_tokens(rows, 16, vocab, seed), _classes(rows, seed)),
            classify_loss)


def _mixed(tiny: bool, seed: int) -> tuple[nn.Module, Any, Any]:
    vocab, dim, depth, rows = (1000, 64, 3, 12) if tiny else (40000, 512, 6, 48)
    return MixedDtypes(vocab, dim, depth), (_tokens(rows, 16, vocab, seed), _classes(rows, seed)), classify_loss


ZOO: dict[str, ZooModel] = {z.name: z for z in (
    ZooModel(name="mlp-deep", drives="many small layers: activations and per-tensor overheads", build=_deep),
    ZooModel(name="mlp-wide", drives="few large weights: model state and gradient buckets", build=_wide),
    ZooModel(name="embed-untied", drives="a large embedding and an untied vocabulary head",
             build=_embed(tied=False)),
    ZooModel(name="embed-tied", drives="a large embedding whose gradient accumulates twice (tied head)",
             build=_embed(tied=True)),
    ZooModel(name="conv-bn", drives="convolution activations and BatchNorm buffers", build=_conv),
    ZooModel(name="transformer-long", drives="attention over long sequences: activations", build=_long),
    ZooModel(name="hf-bert", drives="HuggingFace BertForMaskedLM (tied decoder) from a config",
             build=_hf_builder("bert")),
    ZooModel(name="hf-gpt2", drives="HuggingFace GPT2LMHeadModel (tied head) from a config",
             build=_hf_builder("gpt2")),
    ZooModel(name="hf-llama", drives="HuggingFace LlamaForCausalLM (untied head, GQA) from a config",
             build=_hf_builder("llama")),
    ZooModel(name="frozen", drives="a frozen embedding and half the layers: parameters without gradients",
             build=_frozen),
    ZooModel(name="mixed-dtypes", drives="a bfloat16 embedding beside float32 layers", build=_mixed),
)}
"""The validation zoo, by name."""


def build(name: str, *, size: str = "bench",
          seed: int = 0) -> tuple[nn.Module, Any, Callable[..., torch.Tensor] | None]:
    """``(model, global batch, loss_fn or None)`` of zoo entry ``name`` at ``size``, the same for the
    same ``seed`` (weights and batch).

    Example::

        model, (x, y), loss_fn = build("mlp-deep", size="tiny")
    """
    if name not in ZOO:
        raise ValueError(f"zoo model {name!r} is not one of {', '.join(ZOO)}")
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {', '.join(SIZES)}")
    torch.manual_seed(seed)
    return ZOO[name].build(size == "tiny", seed)
