"""Ranks stay in step or stop (see [Note: ranks in step] in dspark.engine.window): a rank that skipped
a batch or a step is a CollectiveError on every rank at the next collective, never a reduction that
pairs one rank's batch with another's, and the whole-state calls refuse ranks at different steps."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import dspark
from tests.engine import tiny_models as tm
from tests.messages import assert_line_names

SGD = functools.partial(torch.optim.SGD, lr=0.1)


class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises: an error inside engine.backward before any gradient is ready."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a failure of this rank's backward")


def _skip_one_batch(strategy: str) -> dict[str, Any]:
    """Rank 1 catches an error in its backward at step 1 and goes on with the next batch, as a loop
    with ``try: ... except RuntimeError: continue`` does."""
    rank = dspark.get_world().rank
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy=strategy)
    error, at = None, None
    for step in range(4):
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
        try:
            loss = tm.loss_fn("mlp", engine(x), y)  # zero3 gathers here: the forward may part first
            if rank == 1 and step == 1:
                loss = _FailInBackward.apply(loss)
            engine.backward(loss)
            engine.step()
        except dspark.CollectiveError as exc:
            error, at = str(exc), step
            break
        except RuntimeError:
            continue  # the skipped batch
    engine.close()
    return {"error": error, "at": at}


def test_a_rank_that_skips_a_batch_stops_every_rank_at_the_next_collective(pool, strategy: str) -> None:
    for rank, result in enumerate(pool.run(_skip_one_batch, strategy)):
        message = result["error"]
        assert message is not None, f"rank {rank} under {strategy}: trained on out of step"
        assert result["at"] == (1 if rank == 0 else 2), result  # rank 0's step 1 met rank 1's step 2
        assert message.startswith(f"rank {rank}:"), message
        if strategy != "zero3":  # zero3 parts at its first gather, whose tags name the phases
            assert_line_names(message, "rank 0: window 1", "1 backward()")
            assert_line_names(message, "rank 1: window 2", "1 backward()")


def _skip_one_step(strategy: str, then: str, tmp: str) -> dict[str, Any]:
    rank = dspark.get_world().rank
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy=strategy)
    where = "training"
    try:
        for step in range(2):
            x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
            engine.backward(tm.loss_fn("mlp", engine(x), y))
            if not (rank == 1 and step == 1):  # rank 1 skips its second engine.step()
                engine.step()
        where = then
        if then == "full_state_dict":
            engine.full_state_dict(rank0_only=True)
        else:
            engine.save(f"{tmp}/ckpt")
        return {"error": None, "type": None, "where": where}
    except Exception as exc:
        return {"error": str(exc), "type": type(exc).__name__, "where": where}
    finally:
        engine.close()


@pytest.mark.parametrize("then", ["full_state_dict", "save"])
def test_a_rank_that_skipped_step_is_refused_by_the_whole_state_calls(pool, tmp_path, strategy: str,
                                                                      then: str) -> None:
    results = pool.run(_skip_one_step, strategy, then, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["type"] == "CollectiveError", (rank, strategy, then, result)
        message = result["error"]
        assert message.startswith(f"rank {rank}:"), message
    if strategy != "replicate":
        # their step has a collective of its own: zero1 all-gathers the updated rows, zero2 and
        # zero3 first all-reduce the flag of a non-finite gradient in their shards; rank 0's step
        # meets rank 1's state call, and the collectives' labels say what each rank was doing
        assert results[0]["where"] == "training" and results[1]["where"] == then, results
        step_label = ("dspark.bucket0.all_gather" if strategy == "zero1"
                      else "dspark.nonfinite_grads.all_reduce")
        for result in results:
            assert step_label in result["error"] and f"dspark.{then}.step_check" in result["error"], result
    else:
        for result in results:
            assert result["where"] == then, results
            assert_line_names(result["error"], f"engine.{then}()", "different points")
            assert_line_names(result["error"], "rank 0: step 2", "window 2", "0 backward()")
            assert_line_names(result["error"], "rank 1: step 1", "window 1", "1 backward()")
    assert not (tmp_path / "ckpt").exists()


def _in_step(strategy: str) -> dict[str, Any]:
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy=strategy, grad_accum_steps=2)
    for step in range(3):
        for micro in range(2):
            x, y = dspark.distribute_batch(tm.batch("mlp", 8, 2 * step + micro), shard_dim=0)
            engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
    with torch.no_grad():  # an evaluation between steps is not a training forward
        engine(torch.zeros(2, 6))
    state = engine.full_state_dict()
    engine.close()
    return {"steps": engine.step_count, "keys": sorted(state)}


def test_ranks_in_step_train_and_export_as_before(pool, strategy: str) -> None:
    for result in pool.run(_in_step, strategy):
        assert result["steps"] == 3 and "layers.0.weight" in result["keys"], result


def _forward_here_state_dict_there() -> dict[str, Any]:
    """zero3: rank 0 runs a training forward while rank 1 asks for the full state dict."""
    rank = dspark.get_world().rank
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy="zero3")
    try:
        if rank == 0:
            engine(torch.zeros(2, 6))
        else:
            engine.full_state_dict()
        return {"error": None}
    except dspark.CollectiveError as exc:
        return {"error": str(exc)}
    finally:
        engine.close()


def test_a_mismatch_names_what_each_rank_was_doing(pool) -> None:
    forward, state_dict = pool.run(_forward_here_state_dict_there)
    for message in (forward["error"], state_dict["error"]):
        assert message is not None and "dspark.full_state_dict.step_check" in message, message
        assert "dspark.gather." in message, message  # rank 0's gather of a unit for its forward
    assert "training forward" not in state_dict["error"], state_dict
