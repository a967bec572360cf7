"""fp16 overflows where one process on the whole batch overflows, no sooner (see the engine's
[Note: fp16 share of the batch]).

The model is built so that the largest fp16 value in backward is each sample's output gradient,
``scale * C / B`` in one process on ``B`` samples: the inputs alternate in sign, so the weight's
gradient (a sum over samples) stays small, and there is no bias. ``C`` puts that gradient at 40000, a
little over half of fp16's largest value (65504): a rank whose loss is the mean over its own ``B / 2``
samples, scaled as a whole batch's, carries 80000 and overflows on every step; ``weight=n`` made it
``n`` times worse. The reference is ``torch.autocast`` + ``torch.amp.GradScaler`` on the whole batch.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import dspark
from dspark.engine import LossScaler
from tests.messages import assert_names

BATCH, STEPS, SCALE = 8, 3, 2.0 ** 10
C = 40000.0 * BATCH / SCALE   # each sample's output gradient in one process: 40000 in fp16


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.mul_(0.01)
    return model


def _batch() -> torch.Tensor:
    signs = torch.tensor([1.0, -1.0]).repeat(BATCH // 2)
    return torch.ones(BATCH, 4) * signs[:, None] * torch.linspace(1.0, 1.1, BATCH)[:, None]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out.float() * C).mean()


def _reference() -> dict[str, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    applied = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(_batch())
        scaler.scale(_loss(out)).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        applied.append(scaler.get_scale() >= before)
        opt.zero_grad(set_to_none=True)
    return {"applied": applied, "scale": scaler.get_scale(), "weight": model.weight.detach().clone()}


def _engine_run(strategy: str, weight: float | None) -> dict[str, Any]:
    engine = dspark.Engine(_model(), optimizer=functools.partial(torch.optim.SGD, lr=1e-3),
                           strategy=strategy, precision="fp16", loss_scaler=LossScaler(scale=SCALE))
    applied = []
    for _ in range(STEPS):
        x = dspark.distribute_batch(_batch(), shard_dim=0)
        engine.backward(_loss(engine(x)), weight=weight)
        applied.append(engine.step())
    result = {"applied": applied, "scale": engine.loss_scale,
              "weight": engine.full_state_dict()["weight"].clone()}
    engine.close()
    return result


@pytest.mark.parametrize("weight", [None, 4.0, 4096.0], ids=["no weight", "weight=4", "weight=4096"])
@pytest.mark.parametrize("strategy", ["replicate", "zero2", "zero3"])
def test_fp16_skips_exactly_the_steps_one_process_skips(pool, strategy: str, weight: float | None) -> None:
    want = _reference()
    assert want["applied"] == [True] * STEPS  # the reference itself never overflows
    for rank, got in enumerate(pool.run(_engine_run, strategy, weight)):
        assert got["applied"] == want["applied"], (
            f"rank {rank}: {strategy}, weight={weight}: steps applied {got['applied']} vs one process's "
            f"{want['applied']} (loss scale {got['scale']} vs {want['scale']})")
        assert got["scale"] == want["scale"]
        torch.testing.assert_close(got["weight"], want["weight"], rtol=1e-3, atol=1e-6)


# rank -> this window's weights, one per micro-batch: rank 0's first is 0 (its first micro-batch
# counts for nothing), so the shared unit comes from rank 1's first weight alone
WINDOW_WEIGHTS = {0: [0.0, 3.0], 1: [2.0, 5.0]}


def _micro_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 4, generator=g) for _ in WINDOW_WEIGHTS[rank]]


def _weighted_reference() -> torch.Tensor:
    """One process: the weighted mean over every micro-batch of both ranks, under fp16 autocast."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    total = sum(sum(w) for w in WINDOW_WEIGHTS.values())
    for _ in range(2):
        loss = torch.zeros(())
        for rank, weights in WINDOW_WEIGHTS.items():
            for w, x in zip(weights, _micro_batches(rank), strict=True):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = loss + w * (out.float() ** 2).mean() / total
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model.weight.detach().clone()


def _weighted_engine(strategy: str) -> torch.Tensor:
    rank = dspark.get_world().rank
    engine = dspark.Engine(_model(), optimizer=functools.partial(torch.optim.SGD, lr=0.5),
                           strategy=strategy, precision="fp16", grad_accum_steps=2,
                           loss_scaler=LossScaler(scale=SCALE), batch_check_every=None)
    for _ in range(2):
        for w, x in zip(WINDOW_WEIGHTS[rank], _micro_batches(rank), strict=True):
            engine.backward((engine(x).float() ** 2).mean(), weight=w)
        assert engine.step()
    weight = engine.full_state_dict()["weight"].clone()
    engine.close()
    return weight


@pytest.mark.parametrize("strategy", ["replicate", "zero2", "zero3"])
def test_fp16_weighted_accumulation_is_the_weighted_mean_of_one_process(pool, strategy: str) -> None:
    want = _weighted_reference()
    for rank, got in enumerate(pool.run(_weighted_engine, strategy)):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5,
                                   msg=lambda m, r=rank: f"rank {r}, {strategy}: {m}")


def test_a_loss_scaler_without_fp16_is_refused(single_process) -> None:
    with pytest.raises(ValueError) as caught:
        dspark.Engine(_model(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                      precision="bf16", loss_scaler=LossScaler(scale=1024.0))
    assert_names(str(caught.value), "loss_scaler=", "precision='bf16'", "'fp16'")
