"""Non-finite gradients (see [Note: non-finite steps] in dspark.engine.update): a NaN in one rank's loss
skips the step on every rank in every precision, parameters untouched, and a run of such steps stops
with an error naming the limit."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch

import dspark
from tests.engine import tiny_models as tm
from tests.engine.harness import with_deferred_host_reads
from tests.messages import assert_line_names, assert_names

SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _nan_on_rank_1(strategy: str, precision: str, nan_steps: list[int], limit: int | None,
                   skip: bool = True) -> dict[str, Any]:
    rank = dspark.get_world().rank
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy=strategy, precision=precision,
                           skip_nonfinite=skip, max_nonfinite_skips=limit)
    applied, error, unchanged = [], None, []
    try:
        for step in range(4):
            before = engine.full_state_dict()
            x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
            loss = tm.loss_fn("mlp", engine(x), y)
            if rank == 1 and step in nan_steps:
                loss = loss * float("nan")
            engine.backward(loss)
            applied.append(engine.step())
            after = engine.full_state_dict()
            unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
    except FloatingPointError as exc:
        error = str(exc)
    finite = all(bool(torch.isfinite(v).all()) for v in engine.full_state_dict().values())
    out = {"applied": applied, "unchanged": unchanged, "error": error, "finite": finite,
           "nonfinite_steps": engine.nonfinite_steps, "step_count": engine.step_count}
    engine.close()
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["replicate", "zero2"])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(pool, strategy: str, precision: str) -> None:
    for rank, result in enumerate(pool.run(_nan_on_rank_1, strategy, precision, [1], 5)):
        assert result["applied"] == [True, False, True, True], (rank, result)
        assert result["unchanged"] == [False, True, False, False], (rank, result)
        assert result["finite"] and result["nonfinite_steps"] == 1 and result["step_count"] == 3, result


def test_skip_nonfinite_false_applies_the_nan_as_pytorch_does(pool) -> None:
    for result in pool.run(_nan_on_rank_1, "replicate", "fp32", [1], None, False):
        assert result["applied"] == [True, True, True, True] and not result["finite"], result


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_nonfinite_steps_in_a_row_raise_naming_the_limit(pool, strategy: str) -> None:
    for rank, result in enumerate(pool.run(_nan_on_rank_1, strategy, "fp32", [1, 2, 3], 3)):
        assert result["applied"] == [True, False, False], (rank, result)
        assert result["error"] is not None and result["error"].startswith(f"rank {rank}:"), result
        assert_line_names(result["error"], "3 steps", "max_nonfinite_skips=3")
        assert result["finite"] and result["nonfinite_steps"] == 3, result


def test_a_finite_step_resets_the_count_in_a_row(pool) -> None:
    for result in pool.run(_nan_on_rank_1, "zero1", "fp32", [0, 2], 2):
        assert result["applied"] == [False, True, False, True] and result["error"] is None, result
        assert result["nonfinite_steps"] == 2, result


def test_the_limit_is_checked(single_process) -> None:
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError) as caught:
            dspark.Engine(tm.make("mlp"), optimizer=SGD, max_nonfinite_skips=bad)
        assert_names(str(caught.value), f"max_nonfinite_skips={bad!r}", ">= 1", "None")
    with pytest.raises(TypeError, match="skip_nonfinite='yes'"):
        dspark.Engine(tm.make("mlp"), optimizer=SGD, skip_nonfinite="yes")  # type: ignore[arg-type]


# -- a non-finite gradient behind a finite loss (see [Note: non-finite gradients found in the reduction])

def _tanh_mlp() -> torch.nn.Module:
    with torch.random.fork_rng():  # the same model on every rank; the batches still differ
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _inf_input_on_rank_1(strategy: str, precision: str, ranks: int = 2) -> dict[str, Any]:
    """Three steps; in the second, rank 1's input holds one ``inf``: each first-layer output is
    +-inf, tanh makes it +-1, so the loss is finite while the first layer's gradient is not."""
    rank = dspark.get_world().rank
    engine = dspark.Engine(_tanh_mlp(), optimizer=SGD, strategy=strategy, precision=precision)
    applied, losses, unchanged, calls = [], [], [], []
    for step in range(3):
        before = engine.full_state_dict()
        x = torch.randn(4, 8)
        if step == 1 and rank == ranks - 1:
            x[0, 0] = float("inf")
        loss = engine(x).float().pow(2).mean()
        losses.append(float(loss.detach()))
        engine.backward(loss)
        counted = {k: v.calls for k, v in dspark.comm.stats().items()}
        applied.append(engine.step())
        calls.append({k: v.calls - counted.get(k, 0) for k, v in dspark.comm.stats().items()
                      if v.calls != counted.get(k, 0)})
        after = engine.full_state_dict()
        unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
    state = engine.full_state_dict()
    out = {"applied": applied, "losses": losses, "unchanged": unchanged, "state": state,
           "finite": all(bool(torch.isfinite(v).all()) for v in state.values()),
           "nonfinite_steps": engine.nonfinite_steps, "step_calls": calls}
    engine.close()
    return out


@pytest.mark.parametrize("order", ["host_decides", "device_skips"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_an_inf_gradient_behind_a_finite_loss_skips_the_step_on_every_rank(
        pool, strategy: str, precision: str, order: str) -> None:
    task = (_inf_input_on_rank_1 if order == "host_decides"
            else functools.partial(with_deferred_host_reads, _inf_input_on_rank_1))
    results = pool.run(task, strategy, precision)
    for rank, result in enumerate(results):
        assert all(math.isfinite(v) for v in result["losses"]), (rank, result["losses"])
        assert result["applied"] == [True, False, True], (rank, result["applied"])
        assert result["unchanged"] == [False, True, False], (rank, result["unchanged"])
        assert result["finite"] and result["nonfinite_steps"] == 1, (rank, result)
    for key, value in results[0]["state"].items():  # one model on every rank
        assert torch.equal(value, results[1]["state"][key]), key


def test_the_check_rides_in_the_reduction(pool, strategy: str) -> None:
    """No collective is added to a step for it (replicate, zero1), or one of one element (zero2, zero3,
    whose ranks each hold a shard of the gradients)."""
    off = pool.run(_step_calls_without_the_check, strategy)[0]
    sharded = strategy in ("zero2", "zero3")
    for result in pool.run(_inf_input_on_rank_1, strategy, "fp32"):
        with_check = result["step_calls"][2]
        extra = {k: with_check.get(k, 0) - off.get(k, 0) for k in set(with_check) | set(off)}
        assert {k: v for k, v in extra.items() if v} == ({"all_reduce": 1} if sharded else {}), extra


def _step_calls_without_the_check(strategy: str) -> dict[str, int]:
    engine = dspark.Engine(_tanh_mlp(), optimizer=SGD, strategy=strategy, skip_nonfinite=False)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        counted = {k: v.calls for k, v in dspark.comm.stats().items()}
        engine.step()
    calls = {k: v.calls - counted.get(k, 0) for k, v in dspark.comm.stats().items()
             if v.calls != counted.get(k, 0)}
    engine.close()
    return calls


def test_one_rank_skips_an_inf_gradient_too(single_process, strategy: str) -> None:
    result = _inf_input_on_rank_1(strategy, "fp32", ranks=1)
    assert result["applied"] == [True, False, True] and result["finite"], result
