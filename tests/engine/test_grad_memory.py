"""Where a rank's gradients live during backward, held to one process's step measured in the same
rank: the engine holds no second copy of a gradient (see [Note: a bucket of one adopts its gradient]
and [Note: packed as they arrive] in :mod:`dspark.engine.grad_bucket`)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import dspark
from dspark.planner.peak_memory import measure_peak_bytes

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
VOCAB, DIM = 8000, 64
EMBEDDING_BYTES = VOCAB * DIM * 4


class _Bag(nn.Module):
    """A large embedding (its gradient, complete last, alone in its bucket) and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def _mlp() -> nn.Module:
    """Eight layers whose gradients share one bucket, activations negligible beside them."""
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def _model(build: str) -> nn.Module:
    torch.manual_seed(0)
    return _Bag() if build == "bag" else _mlp()


def _one_process_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    opt = ADAMW(model.parameters(), fused=True)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return measure_peak_bytes(step)


def _peaks(build: str, strategy: str, bucket_mb: float) -> dict[str, int]:
    """This rank's tensor peak of one engine step, and of one process's step on the same local batch
    (measured first, with nothing else of the model held)."""
    g = torch.Generator().manual_seed(dspark.get_world().rank)
    x = torch.randint(0, VOCAB, (8, 16), generator=g) if build == "bag" else torch.randn(8, 256, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    one_process = _one_process_peak(_model(build), x, y)
    engine = dspark.Engine(_model(build), optimizer=ADAMW, strategy=strategy, bucket_mb=bucket_mb)

    def step() -> None:
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()

    step()
    step()  # from the second window on, gradients are packed as they arrive
    peak = measure_peak_bytes(step)
    engine.close()
    return {"engine": peak, "one_process": one_process}


def test_a_large_embedding_alone_in_its_bucket_has_one_gradient(pool) -> None:
    """replicate: the bucket adopts the gradient autograd made, so the step's peak is one process's;
    copying it into a new flat buffer held two copies at the end of backward (the embedding's whole
    gradient above one process's peak). zero1's peak is its row gather after the step, elsewhere."""
    for rank in pool.run(_peaks, "bag", "replicate", 1.0):
        assert rank["engine"] - rank["one_process"] < EMBEDDING_BYTES // 4, rank


def test_zero3_never_holds_whole_gradients_beside_their_send_buffer(pool) -> None:
    """Every gradient in one bucket. One process holds parameters, gradients and AdamW's two moments
    (4 G, G the gradients' bytes); a zero3 rank, packing gradients as they arrive, half the
    parameters and moments, the send buffer and its shard (3 G) and a unit or two gathered: at least
    3 G / 4 below. Packed at launch, it held the gradients whole beside the send buffer: G / 2 more."""
    grads = sum(p.numel() * 4 for p in _mlp().parameters())
    for rank in pool.run(_peaks, "mlp", "zero3", 25.0):
        assert rank["one_process"] - rank["engine"] >= 3 * grads // 4, (rank, grads)
