"""Finding 3 of issue 7: under fp16 an overflow that lands only in the rows one rank owns. zero1 keeps
whole all-reduced gradients but each rank checks only its own rows for inf/nan, so the rank that owns
the overflow skips the step and the other steps and enters the row all-gather alone. Every rank must
agree: skip together, leave parameters, optimizer and each other in step, and train on afterwards."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import dspark
from dspark.engine import LossScaler
from tests.engine.harness import run_or_explain_hang

SCALE = 2.0**10
POISON = 1e3
"""d loss / d out[:, 3] = POISON * SCALE = 1e6 > 65504 (fp16's largest): the fp16 gradient of output 3 is
inf, so only row 3 of the weight and element 3 of the bias overflow. With 4 rows on 2 ranks, rank 0
owns rows 0-1 and rank 1 rows 2-3: the overflow is in rank 1's rows only."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 4)  # the input needs no gradient: nothing carries the inf to other rows


def _batch() -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


def _loss(out: torch.Tensor, poison: bool) -> torch.Tensor:
    loss = out[:, :3].float().square().mean()
    return loss + POISON * out[:, 3].float().sum() if poison else loss


def test_the_crafted_gradient_overflows_only_in_rank_1s_rows() -> None:
    """The premise, in plain PyTorch: autocast fp16, the loss times the engine's loss scale."""
    model = _model()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(_batch())
    (_loss(out, poison=True) * SCALE).backward()
    finite_rows = torch.isfinite(model.weight.grad).all(dim=1).tolist()
    assert finite_rows == [True, True, True, False], finite_rows
    assert torch.isfinite(model.bias.grad).tolist() == [True, True, True, False]


def _overflow_in_rank_1s_rows(strategy: str) -> dict[str, Any]:
    engine = dspark.Engine(_model(), optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy=strategy,
                           precision="fp16", loss_scaler=LossScaler(scale=SCALE), bucket_mb=1e-4)
    x = dspark.distribute_batch(_batch(), shard_dim=0)

    def train_step(poison: bool) -> bool:
        engine.backward(_loss(engine(x), poison))
        return engine.step()

    assert train_step(poison=False)
    before = engine.full_state_dict()
    applied = train_step(poison=True)
    after_skip = engine.full_state_dict()
    scale_after_skip = engine.loss_scale
    good = [train_step(poison=False) for _ in range(2)]
    out = {"applied": applied, "before": before, "after_skip": after_skip, "scale_after_skip": scale_after_skip,
           "good": good, "final": engine.full_state_dict()}
    engine.close()
    return out


def test_overflow_in_one_ranks_rows_skips_the_step_on_every_rank(pool, strategy: str) -> None:
    results = run_or_explain_hang(
        pool, _overflow_in_rank_1s_rows, strategy, timeout_s=30,
        hang_means=f"under {strategy} one rank skipped the fp16 step (overflow in the rows it owns) and the "
                   "other stepped and waits alone in a collective: the ranks must agree on the overflow")
    applied = [r["applied"] for r in results]
    assert applied == [False, False], f"{strategy}: step() returned {applied} on ranks 0, 1 (want both False)"
    for rank, result in enumerate(results):
        for key, value in result["before"].items():
            assert torch.equal(result["after_skip"][key], value), f"rank {rank}: {key} changed by a skipped step"
        assert result["scale_after_skip"] == SCALE / 2, (rank, result["scale_after_skip"])
        assert result["good"] == [True, True], (rank, result["good"])
    for key, value in results[0]["final"].items():
        assert torch.equal(results[1]["final"][key], value), f"{strategy}: ranks differ in {key} after the skip"
