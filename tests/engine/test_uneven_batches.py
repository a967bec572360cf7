"""Unequal local batches (finding 6 of issue 7): ``distribute_batch(..., allow_uneven=True)`` on a batch
that does not divide by the world size, and token-weighted losses where ranks hold different numbers of
valid (not ``ignore_index``) tokens. The contract: ``engine.backward(loss, weight=n)``, where ``loss`` is
this rank's mean over its ``n`` samples or tokens, makes the step equal to one process on the mean over
every rank's samples (and every micro-batch's, with accumulation). A rank with ``n = 0`` contributes
nothing and makes no NaN, even when its loss is 0/0. Without ``weight``, local batches of different
sizes are refused on every rank with a message that names the fix: equal weights would silently give
another update than one process."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import dspark
from tests.engine import tiny_models as tm
from tests.engine.harness import OPTIMIZERS, assert_close, micro_batches, run_or_explain_hang
from tests.messages import assert_line_names

STEPS = 3
IGNORE = -100
Loss = Callable[[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]], tuple[torch.Tensor, int]]


def _rows_loss(forward: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return F.mse_loss(forward(x), y), x.shape[0]  # mean over this batch's rows (NaN for none)


def _ignore_index_loss(forward: Callable[..., torch.Tensor],
                       batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
    """PyTorch's mean over the targets that are not ``ignore_index`` (NaN when there is none; its
    gradient is then zero)."""
    tokens, targets = batch
    loss = F.cross_entropy(forward(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    return loss, int((targets != IGNORE).sum())


def _masked_tokens_loss(forward: Callable[..., torch.Tensor],
                        batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int]:
    """The same mean as custom loops write it: per-token losses times a mask, summed, over the count.
    With no valid token it is 0/0, and so is its gradient: NaN everywhere on that rank."""
    tokens, targets = batch
    mask = targets != IGNORE
    per_token = F.cross_entropy(forward(tokens).flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none")
    return (per_token * mask.flatten()).sum() / mask.sum(), int(mask.sum())


def _rows(global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tm.batch("mlp", global_batch, step)


def _tokens(ignored_per_rank: tuple[int, int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of 5 tokens; the first 4 (rank 0's) ignore the last ``ignored_per_rank[0]`` targets,
    the last 4 (rank 1's) the last ``ignored_per_rank[1]``."""
    tokens, targets = tm.batch("tied", 8, step)
    targets = targets.clone()
    for half, ignored in enumerate(ignored_per_rank):
        if ignored:
            targets[4 * half: 4 * half + 4, 5 - ignored:] = IGNORE
    return tokens, targets


KINDS: dict[str, tuple[str, Callable[[int], tuple[torch.Tensor, torch.Tensor]], Loss, int]] = {
    # name: (model, step -> global batch, loss, grad_accum_steps)
    "7_rows_split_4_3": ("mlp", functools.partial(_rows, 7), _rows_loss, 1),
    "1_row_rank_1_has_none": ("mlp", functools.partial(_rows, 1), _rows_loss, 1),
    "7_rows_in_2_micro_batches": ("mlp", functools.partial(_rows, 7), _rows_loss, 2),
    "valid_tokens_16_vs_4": ("tied", functools.partial(_tokens, (1, 4)), _ignore_index_loss, 1),
    "valid_tokens_16_vs_4_masked": ("tied", functools.partial(_tokens, (1, 4)), _masked_tokens_loss, 1),
    "rank_1_has_no_valid_token": ("tied", functools.partial(_tokens, (1, 5)), _ignore_index_loss, 1),
    "rank_1_has_no_valid_token_masked": ("tied", functools.partial(_tokens, (1, 5)), _masked_tokens_loss, 1),
}


def _reference(kind: str) -> dict[str, torch.Tensor]:
    """One process, the mean over the whole global batch."""
    model_name, batch, loss_fn, _ = KINDS[kind]
    model = tm.make(model_name)
    opt = OPTIMIZERS["sgd"](model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch(step))[0].backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(kind: str, strategy: str, weighted: bool) -> dict[str, torch.Tensor]:
    model_name, batch, loss_fn, accum = KINDS[kind]
    engine = dspark.Engine(tm.make(model_name), optimizer=OPTIMIZERS["sgd"], strategy=strategy,
                           grad_accum_steps=accum, bucket_mb=1e-4)
    for step in range(STEPS):
        for micro in micro_batches(batch(step), accum):
            loss, count = loss_fn(engine, dspark.distribute_batch(micro, shard_dim=0, allow_uneven=True))
            if weighted:
                engine.backward(loss, weight=count)
            else:
                engine.backward(loss)
        if not engine.step():
            raise AssertionError(f"step {step} was skipped")
    state = engine.full_state_dict()
    engine.close()
    return state


def test_the_kinds_really_are_uneven() -> None:
    assert [len(t) for t in torch.tensor_split(_rows(7, 0)[0], 2)] == [4, 3]
    assert [len(t) for t in torch.tensor_split(_rows(1, 0)[0], 2)] == [1, 0]
    for ignored, counts in (((1, 4), [16, 4]), ((1, 5), [16, 0])):
        targets = _tokens(ignored, 0)[1]
        assert [int((half != IGNORE).sum()) for half in targets.chunk(2)] == counts


@pytest.mark.parametrize("kind", KINDS)
def test_weighted_backward_equals_one_process_on_the_whole_batch(pool, strategy: str, kind: str) -> None:
    want = _reference(kind)
    states = run_or_explain_hang(pool, _engine, kind, strategy, True, timeout_s=30,
                                 hang_means=f"{kind} under {strategy}: the ranks with different (or no) samples "
                                            "ended in different collectives")
    for rank, state in enumerate(states):
        bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
        assert not bad, f"rank {rank}: {kind} under {strategy}: NaN/inf in {bad}"
        assert_close(state, want, f"rank {rank}: engine.backward(loss, weight=n) on {kind} under {strategy} "
                     "against one process's mean over the whole batch")


def _engine_or_error(kind: str, strategy: str) -> str:
    try:
        _engine(kind, strategy, weighted=False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_unequal_batches_without_weight_are_refused_with_the_fix(pool, strategy: str) -> None:
    """4 + 3 rows and ``engine.backward(loss)``: equal weights would not give the mean over the 7 rows,
    so every rank refuses, with the counts and the fix (``weight=``) in the message."""
    messages = run_or_explain_hang(pool, _engine_or_error, "7_rows_split_4_3", strategy, timeout_s=30,
                                   hang_means="one rank refused the unequal batches and the other went on")
    for rank, message in enumerate(messages):
        assert message != "no error", f"rank {rank}: 4 + 3 rows without weight= trained with equal weights"
        assert "weight=" in message and "4" in message and "3" in message, f"rank {rank}: {message}"


def _extra_backward_on_rank_0(strategy: str) -> str:
    import functools

    import dspark
    from tests.engine import tiny_models as tm

    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           strategy=strategy, grad_accum_steps=2)
    rank = dspark.get_world().rank
    try:
        for micro in range(2 if rank == 0 else 1):
            x, y = dspark.distribute_batch(tm.batch("mlp", 8, micro), shard_dim=0)
            engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        engine.close()


@pytest.mark.parametrize("strategy", ["replicate", "zero2"])
def test_a_different_number_of_backward_calls_is_named_as_such(pool, strategy: str) -> None:
    """Rank 0 runs two micro-batches, rank 1 one: equal batch sizes per call, but twice the samples on
    rank 0 in the window; the error says how many backward() calls each rank made, not 'unequal
    batches' (which would send the user to the loader's batch size)."""
    messages = run_or_explain_hang(pool, _extra_backward_on_rank_0, strategy, timeout_s=30,
                                   hang_means="one rank refused and the other went on")
    for rank, message in enumerate(messages):
        assert_line_names(message, "engine.backward()", "different number")
        assert "rank 0: 2, rank 1: 1" in message, (rank, message)
