"""Training cases by name: a model, the global batch of each step, and the loss a user computes from a
forward. The engine run and the single-process reference in ``harness.py`` train the same case, so a
case is named (a string travels to the ranks; the case itself is rebuilt there).

A case's loss takes ``forward`` (the engine, or the plain model, or the model under autocast) and a
batch (the whole global batch, a micro-batch of it, or this rank's slice): it must weigh every sample
equally, so that the mean over ranks of equal slices is the mean over the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.engine import hf_models
from tests.engine import tiny_models as tm

GLOBAL_BATCH = 8
EVAL_STEP = 100
"""Evaluation uses the batch of this step: one no training step saw."""

Batch = tuple[torch.Tensor, ...]
Forward = Callable[..., Any]


@dataclass(frozen=True, kw_only=True)
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    """step -> the global batch of that step; every tensor has the samples along dim 0."""
    loss: Callable[[Forward, Batch], torch.Tensor]
    evaluate: Callable[[Forward, Batch], torch.Tensor]
    """The model's output on a batch, compared in eval mode under torch.no_grad()."""


def _out(forward: Forward, batch: Batch) -> torch.Tensor:
    return forward(batch[0])  # type: ignore[no-any-return]


def _mse(forward: Forward, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(forward(x).float(), y)


def _mse_per_branch(forward: Forward, batch: Batch) -> torch.Tensor:
    """Both halves of the output against the same target: each branch's gradient is its own."""
    x, y = batch
    return F.mse_loss(forward(x).float(), torch.cat([y, y], dim=1))


def _next_token(forward: Forward, batch: Batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(forward(tokens).float().flatten(0, 1), targets.flatten())


def _image_classes(forward: Forward, batch: Batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(forward(images).float(), labels)


def _two_forwards(forward: Forward, batch: Batch) -> torch.Tensor:
    """Two forwards before one backward (e.g. a contrastive pair); halves of equal size, so the sum
    of the two means is twice the mean over the batch on any split."""
    x, y = batch
    (x1, x2), (y1, y2) = x.chunk(2), y.chunk(2)
    return F.mse_loss(forward(x1).float(), y1) + F.mse_loss(forward(x2).float(), y2)


def _hf_loss(forward: Forward, batch: Batch, *, key: str) -> torch.Tensor:
    inputs, labels = batch
    return forward(**{key: inputs}, labels=labels).loss  # type: ignore[no-any-return]


def _hf_logits(forward: Forward, batch: Batch, *, key: str) -> torch.Tensor:
    return forward(**{key: batch[0]}).logits  # type: ignore[no-any-return]


def _mlp_batch(step: int) -> Batch:
    return tm.batch("mlp", GLOBAL_BATCH, step)


def _two_target_batch(step: int) -> Batch:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def _images(step: int, *, channels_last: bool = False) -> Batch:
    g = torch.Generator().manual_seed(5000 + step)
    images = torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=g)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make()
    return build


def _frozen_first_layer() -> nn.Module:
    model = tm.make("mlp")
    model.layers[0].requires_grad_(False)
    return model


def _conv(*, batchnorm: bool, channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = tm.ConvNet(batchnorm=batchnorm)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _mlp_case(build: Callable[[], nn.Module], loss: Callable[[Forward, Batch], torch.Tensor] = _mse) -> Case:
    return Case(build=build, batch=_mlp_batch, loss=loss, evaluate=_out)


def _conv_case(*, batchnorm: bool, channels_last: bool) -> Case:
    return Case(build=functools.partial(_conv, batchnorm=batchnorm, channels_last=channels_last),
                batch=functools.partial(_images, channels_last=channels_last),
                loss=_image_classes, evaluate=_out)


def _hf_case(build: Callable[[], nn.Module], batch: Callable[[int, int], Batch], key: str) -> Case:
    return Case(build=build, batch=functools.partial(batch, GLOBAL_BATCH),
                loss=functools.partial(_hf_loss, key=key), evaluate=functools.partial(_hf_logits, key=key))


CASES: dict[str, Case] = {
    "mlp": _mlp_case(functools.partial(tm.make, "mlp")),
    "tied": Case(build=functools.partial(tm.make, "tied"),
                 batch=functools.partial(tm.batch, "tied", GLOBAL_BATCH), loss=_next_token, evaluate=_out),
    "frozen": _mlp_case(_frozen_first_layer),
    # a two-output head (a binary classifier's): its 2-element bias is one element per rank on 2
    # ranks, the smallest shard a zero3 gather packs beside other parameters
    "two_outputs": Case(build=_seeded(functools.partial(tm.TinyMLP, d_out=2)), batch=_two_target_batch,
                        loss=_mse, evaluate=_out),
    "two_forwards": _mlp_case(functools.partial(tm.make, "mlp"), loss=_two_forwards),
    # hidden layers of 8 rows split evenly over 2 ranks, the 3-row head and the 0-d scale do not
    # (see [Note: rows gathered in place] in dspark.engine.row_gather)
    "even_rows": _mlp_case(_seeded(functools.partial(tm.TinyMLP, hidden=8))),
    "repeated_block": _mlp_case(_seeded(tm.RepeatedBlockNet)),
    "repeated_block_reentrant": _mlp_case(_seeded(functools.partial(tm.RepeatedBlockNet, "reentrant"))),
    "repeated_block_non_reentrant": _mlp_case(
        _seeded(functools.partial(tm.RepeatedBlockNet, "non_reentrant"))),
    "mixed_dtypes": _mlp_case(_seeded(tm.MixedDtypeMLP), loss=_mse_per_branch),
    "conv_channels_last": _conv_case(batchnorm=False, channels_last=True),
    "conv_bn": _conv_case(batchnorm=True, channels_last=False),
    "conv_bn_channels_last": _conv_case(batchnorm=True, channels_last=True),
    "gpt2": _hf_case(hf_models.gpt2, hf_models.token_batch, "input_ids"),
    "bert": _hf_case(hf_models.bert, hf_models.masked_batch, "input_ids"),
    "bert_classifier": _hf_case(hf_models.bert_classifier, hf_models.labelled_batch, "input_ids"),
    "resnet": _hf_case(hf_models.resnet, hf_models.image_batch, "pixel_values"),
}
for _where in ("inside", "unit"):
    for _reentrant in (False, True):
        CASES[f"checkpoint_{_where}_{'reentrant' if _reentrant else 'non_reentrant'}"] = _mlp_case(
            _seeded(functools.partial(tm.CheckpointedNet, _where, _reentrant)))


def get_case(name: str) -> Case:
    try:
        return CASES[name]
    except KeyError:
        raise ValueError(f"no training case {name!r}; known: {', '.join(sorted(CASES))}") from None
