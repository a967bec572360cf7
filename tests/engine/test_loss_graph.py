"""A loss scaled by the accumulation count, read from its autograd graph (no process group)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from dspark.engine.loss_graph import accum_scaling, accum_scaling_message
from tests.messages import assert_names

K = 4
_W = torch.randn(3, requires_grad=True)


def _loss() -> torch.Tensor:
    return (_W * 2).square().mean()


def _scaled(loss: torch.Tensor) -> torch.Tensor:
    return loss / K


def _scaled_by_default(loss: torch.Tensor, k: int = K) -> torch.Tensor:
    return loss / k


def _in_place_division() -> torch.Tensor:
    loss = _loss()
    loss /= K
    return loss


DIVIDED: dict[str, Callable[[], torch.Tensor]] = {
    "loss / k": lambda: _loss() / K,
    "loss /= k": _in_place_division,
    "loss.div_(k)": lambda: _loss().div_(K),
    "torch.div(loss, k)": lambda: torch.div(_loss(), K),
    "loss.mul_(1.0 / k)": lambda: _loss().mul_(1.0 / K),
    "loss * k ** -1": lambda: _loss() * K ** -1,
    "k ** -1 * loss": lambda: K ** -1 * _loss(),
    "loss / numpy int": lambda: _loss() / np.int64(K),
    "a helper": lambda: _scaled(_loss()),
    "a helper's default argument": lambda: _scaled_by_default(_loss()),
    "(loss / k).float()": lambda: (_loss() / K).float(),
    "loss.bfloat16() / k": lambda: (_loss().bfloat16() / K).float(),
    "(loss / k).mean()": lambda: (_loss() / K).mean(),
    "(per-sample losses / k).mean()": lambda: (_W.square() / K).mean(),
    "(per-sample losses / k).sum()": lambda: (_W.square() / K).sum(),
}


@pytest.mark.parametrize("spelling", list(DIVIDED))
def test_every_spelling_of_a_loss_divided_by_the_count_is_read_from_its_graph(spelling: str) -> None:
    found = accum_scaling(DIVIDED[spelling](), K)
    assert found is not None and found.divided, spelling
    assert found.constant in (K, 1 / K)


def test_a_loss_multiplied_by_the_count_is_read_too() -> None:
    for loss in (_loss() * K, _loss() / (1 / K), float(K) * _loss()):
        found = accum_scaling(loss, K)
        assert found is not None and not found.divided


def test_a_third_is_matched_within_rounding() -> None:
    assert accum_scaling(_loss() * (1.0 / 3), 3) is not None
    assert accum_scaling(_loss() / 3, 3) is not None


NOT_SCALED: dict[str, Callable[[], torch.Tensor]] = {
    "a mean loss": _loss,
    "another constant": lambda: _loss() / 3,
    "a sum of terms": lambda: _loss() + 0.1 * _W.square().sum(),
    "a product of two losses": lambda: _loss() * _W.sum(),
    "k / loss": lambda: K / _loss(),
    "a weight that needs a gradient": lambda: _loss() * torch.tensor(0.25, requires_grad=True),
    "a vector of weights": lambda: (_W.square() * torch.full((3,), 1 / K)).sum(),
    "a loss with no graph": lambda: torch.tensor(2.0) / K,
    # a count held in a tensor comes from the data: K in this batch, something else in the next
    "a sum over a token count that is k here": lambda: _W.square().sum() / (torch.arange(K) >= 0).sum(),
    "a sum over a float count that is k here": lambda: _W.square().sum() / torch.tensor(float(K)),
    "a sum over a float64 count that is k here": lambda: _W.square().sum() / torch.tensor(K, dtype=torch.float64),
    "times a tensor that is 1 / k here": lambda: _loss() * torch.tensor(1 / K),
}


@pytest.mark.parametrize("case", list(NOT_SCALED))
def test_losses_not_scaled_by_the_count_pass(case: str) -> None:
    assert accum_scaling(NOT_SCALED[case](), K) is None, case


def test_no_accumulation_divides_nothing() -> None:
    assert accum_scaling(_loss() / 1, 1) is None
    assert accum_scaling(_loss() * 1.0, 1) is None


def test_the_message_names_the_count_the_constant_the_fix_and_the_opt_out() -> None:
    found = accum_scaling(_loss().div_(K), K)
    assert found is not None
    message = accum_scaling_message(found, accum_steps=K, rank=1)
    assert message.startswith("rank 1: ")
    assert_names(message, "divided by grad_accum_steps=4", "4 times too small", "engine.backward(loss)",
                 "division by the constant 4", "allow_accum_scaled_loss=True")
    larger = accum_scaling(_loss() * K, K)
    assert larger is not None
    assert_names(accum_scaling_message(larger, accum_steps=K, rank=0), "multiplied by grad_accum_steps=4",
                 "4 times too large")
