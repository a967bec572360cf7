"""Ranks that disagree (finding 7 of issue 7) must fail on every rank within seconds, with an error that
names the problem, never hang in a collective that a peer never joins: the same-model check covers
``requires_grad`` and buffers, not only parameters' names, shapes and dtypes; a construction error on
one rank (an optimizer factory that raises there) reaches the others; and after a backward that
failed on every rank the engine's state is reset, so training goes on as if it never happened."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import dspark
from tests.engine import tiny_models as tm
from tests.engine.harness import (
    OPTIMIZERS,
    assert_close,
    run_or_explain_hang,
    train_reference,
    train_steps,
)
from tests.messages import assert_names

TIMEOUT_S = 20
_FACTORY_ERROR = "no learning rate configured for this rank"
"""What the user's optimizer factory raises on rank 1 (the engine relays it)."""
"""Agreeing on an error is one small collective; a hang is what this bounds (the pool then restarts)."""


def _construct_and_train(model: nn.Module, strategy: str, optimizer: Any = OPTIMIZERS["sgd"]) -> str:
    """Build the engine and take a step; the error text, or "no error"."""
    try:
        engine = dspark.Engine(model, optimizer=optimizer, strategy=strategy, bucket_mb=1e-4)
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, 0), shard_dim=0)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        engine.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _requires_grad_differs(strategy: str) -> str:
    model = tm.make("mlp")
    if dspark.get_world().rank == 1:
        model.layers[0].weight.requires_grad_(False)  # frozen on one rank only
    return _construct_and_train(model, strategy)


def _buffer_shape_differs(strategy: str) -> str:
    model = tm.make("mlp")
    model.register_buffer("running_stats", torch.zeros(3 if dspark.get_world().rank == 0 else 4))
    return _construct_and_train(model, strategy)


def _factory_raises_on_rank_1(strategy: str) -> str:
    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if dspark.get_world().rank == 1:
            raise ValueError(_FACTORY_ERROR)
        return torch.optim.SGD(params, lr=0.1)
    return _construct_and_train(tm.make("mlp"), strategy, factory)


def _setting_differs(setting: str) -> str:
    """One rank passes another engine argument or optimizer option: fp16 on one rank with fp32 on the
    other turned rank 0's parameters into NaN without a word, and a learning rate read from a per-rank
    config let the replicas drift apart."""
    rank = dspark.get_world().rank
    kwargs: dict[str, Any] = {"strategy": "replicate", "precision": "fp32"}
    lr = 0.1
    if rank == 1:
        if setting == "lr":
            lr = 0.5
        else:
            kwargs[setting] = {"precision": "fp16", "strategy": "zero3"}[setting]
    try:
        engine = dspark.Engine(tm.make("mlp"), optimizer=lambda p: torch.optim.SGD(p, lr=lr), **kwargs)
        engine.close()
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("setting", "says"), [
    ("precision", "precision='fp32' on rank 0 but 'fp16' on rank 1"),
    ("strategy", "strategy='replicate' on rank 0 but 'zero3' on rank 1"),
    ("lr", "param_groups[0]['lr']=0.1 on rank 0 but 0.5 on rank 1"),
])
def test_engine_arguments_and_optimizer_options_that_differ_are_named(pool, setting: str, says: str) -> None:
    messages = run_or_explain_hang(pool, _setting_differs, setting, timeout_s=TIMEOUT_S,
                                   hang_means=f"{setting} differing made a rank wait for another")
    for rank, message in enumerate(messages):
        assert says in message and message.startswith(f"rank {rank}: "), f"rank {rank}: {message}"


def _messages(pool: Any, fn: Any, strategy: str, what: str) -> list[str]:
    messages = run_or_explain_hang(pool, fn, strategy, timeout_s=TIMEOUT_S,
                                   hang_means=f"{what} (under {strategy}) made a rank wait for a peer that "
                                              "had failed or taken another path")
    for rank, message in enumerate(messages):
        assert message != "no error", f"rank {rank}: {what} (under {strategy}) raised nothing"
    return messages  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_requires_grad_that_differs_between_ranks_is_an_error_on_every_rank(pool, strategy: str) -> None:
    for rank, message in enumerate(_messages(pool, _requires_grad_differs, strategy, "requires_grad differing")):
        assert "layers.0.weight" in message and "requires_grad" in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_buffers_that_differ_in_shape_are_an_error_on_every_rank(pool, strategy: str) -> None:
    for rank, message in enumerate(_messages(pool, _buffer_shape_differs, strategy, "a buffer shape differing")):
        assert "running_stats" in message and "(3,)" in message and "(4,)" in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("strategy", ["replicate", "zero1"])
def test_an_optimizer_factory_that_fails_on_one_rank_fails_every_rank(pool, strategy: str) -> None:
    rank0, rank1 = _messages(pool, _factory_raises_on_rank_1, strategy, "an optimizer factory failing on rank 1")
    assert_names(rank1, _FACTORY_ERROR)  # the user's own message, relayed
    assert re.search(r"rank(\(s\))? \[?1\b", rank0) and "optimizer" in rank0, (
        f"rank 0 must say that rank 1's optimizer failed: {rank0}")


def _one_row_model(strategy: str) -> dict[str, Any]:
    """A parameter with one row: rank 1's shard is empty, and torch.optim refuses an empty list."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 1, bias=False), nn.Flatten(0))
    try:
        engine = dspark.Engine(model, optimizer=OPTIMIZERS["adamw"], strategy=strategy, bucket_mb=1e-4)
        for step in range(2):
            x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y[:, 0]))
            engine.step()
        state = engine.full_state_dict()
        engine.close()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "state": state}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_model_smaller_than_the_world_trains_or_fails_on_every_rank(pool, strategy: str) -> None:
    results = run_or_explain_hang(pool, _one_row_model, strategy, timeout_s=TIMEOUT_S,
                                  hang_means=f"under {strategy} rank 1 owns no row, so its optimizer got no "
                                             "parameter; one rank failed and the other waits")
    errors = [r["error"] for r in results]
    if any(errors):
        assert all(errors), f"{strategy}: only some ranks failed: {errors}"
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 1, bias=False), nn.Flatten(0))
    opt = OPTIMIZERS["adamw"](model.parameters())
    for step in range(2):
        x, y = tm.batch("mlp", 8, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y[:, 0]).backward()
        opt.step()
    for rank, result in enumerate(results):
        assert_close(result["state"], model.state_dict(), f"rank {rank}: one-row model under {strategy}")


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed on purpose")


def _fail_a_backward_then_train(strategy: str) -> dict[str, Any]:
    engine = dspark.Engine(tm.make("mlp"), optimizer=OPTIMIZERS["sgd"], strategy=strategy, bucket_mb=1e-4)
    failing = [True]

    def fail_in_backward(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        return _RaiseInBackward.apply(output) if failing[0] else None

    # after the head's gradients (their buckets are sent), before the first layer's
    hook = engine.module.layers[2].register_forward_hook(fail_in_backward)
    x, y = dspark.distribute_batch(tm.batch("mlp", 8, 99), shard_dim=0)
    try:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        first = "no error"
    except RuntimeError as exc:
        first = str(exc)
    failing[0] = False
    hook.remove()
    try:
        train_steps(engine, "mlp", range(3))
    except Exception as exc:
        return {"first": first, "error": f"{type(exc).__name__}: {exc}"}
    out = {"first": first, "error": None, "state": engine.full_state_dict()}
    engine.close()
    return out


def test_training_goes_on_after_a_backward_that_failed_on_every_rank(pool, strategy: str) -> None:
    results = run_or_explain_hang(pool, _fail_a_backward_then_train, strategy, timeout_s=TIMEOUT_S,
                                  hang_means="the failed backward left buckets or collectives behind")
    want = train_reference("mlp", 3, optimizer="sgd")["state"]
    for rank, result in enumerate(results):
        assert "backward failed on purpose" in result["first"], f"rank {rank}: {result['first']}"
        assert result["error"] is None, (f"rank {rank}: after a backward that raised on every rank, training "
                                         f"failed ({strategy}): {result['error']}")
        assert_close(result["state"], want, f"rank {rank}: {strategy}, 3 steps after a failed backward "
                     "against 3 steps of one process (the failed micro-step must leave no gradient)")


