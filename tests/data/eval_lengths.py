"""Evaluation of HuggingFace models at dataset lengths that leave a rank short or with no rows of the
last global batch, as a user writes it: ``dspark.DataLoader(drop_last=False)``, the engine's forward
on every rank, ``dspark.gather_for_metrics`` and ``dspark.reduce_metrics`` per batch. Shared by the
2-rank pool tests and the 4-rank worker (tests/engine/four_ranks_worker.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import dspark
from tests.engine import hf_models

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]]] = {
    "gpt2": (hf_models.gpt2, hf_models.token_batch),
    "bert": (hf_models.bert, hf_models.masked_batch),
    "llama": (hf_models.llama, hf_models.token_batch),
}
"""Each model and its data (every sample weighs the same tokens, so a batch's mean loss times its
samples sums per-sample losses)."""


class Samples(Dataset[dict[str, torch.Tensor]]):
    """``num_samples`` samples of a model's data: ``{"index", "input_ids", "labels"}``."""

    def __init__(self, model: str, num_samples: int) -> None:
        self.inputs, self.labels = MODELS[model][1](num_samples, 0)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(i), "input_ids": self.inputs[i], "labels": self.labels[i]}


def evaluate(model: str, strategy: str, num_samples: int, global_batch_size: int) -> dict[str, Any]:
    """Every rank: one evaluation pass; returns the gathered indices and logits (every sample once,
    in dataset order), the mean loss over the samples, and the local rows each rank's model ran."""
    engine = dspark.Engine(MODELS[model][0](), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           strategy=strategy)
    engine.eval()
    loader = dspark.DataLoader(Samples(model, num_samples), global_batch_size=global_batch_size,
                               shuffle=False, drop_last=False)
    indices, logits, rows = [], [], []
    loss_sum = 0.0
    with torch.no_grad():
        for batch in loader:
            assert loader.batch_info is not None
            out = engine(input_ids=batch["input_ids"], labels=batch["labels"])
            rows.append(len(batch["input_ids"]))
            got = dspark.gather_for_metrics({"index": batch["index"], "logits": out.logits})
            indices.append(got["index"])
            logits.append(got["logits"])
            mean = dspark.reduce_metrics({"loss": out.loss}, weight=len(batch["input_ids"]))["loss"]
            loss_sum += float(mean) * loader.batch_info.global_size
    engine.close()
    return {"index": torch.cat(indices), "logits": torch.cat(logits), "loss": loss_sum / num_samples,
            "rows": rows}


def reference(model: str, num_samples: int) -> dict[str, Any]:
    """One process, plain PyTorch, every sample at once."""
    net = MODELS[model][0]().eval()
    data = Samples(model, num_samples)
    with torch.no_grad():
        out = net(input_ids=data.inputs, labels=data.labels)
    return {"index": torch.arange(num_samples), "logits": out.logits, "loss": float(out.loss)}


def check(results: list[dict[str, Any]], want: dict[str, Any]) -> None:
    """Every rank counted every sample once, in order, with one process's logits and mean loss, and
    no rank's model ran a batch of zero rows."""
    for result in results:
        assert torch.equal(result["index"], want["index"])
        torch.testing.assert_close(result["logits"], want["logits"], rtol=0, atol=1e-5)
        assert abs(result["loss"] - want["loss"]) <= 1e-6 * max(1.0, abs(want["loss"]))
        assert min(result["rows"]) >= 1
