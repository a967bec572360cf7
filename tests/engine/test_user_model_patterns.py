"""Patterns from models and training loops written elsewhere, each trained by every strategy against one
process (SGD, so a wrong factor shows): evaluation (eval mode, ``torch.no_grad``) between steps, which
under zero3 gathers parameters with no backward to follow; a block called twice per forward; several
forwards before one backward; frozen parameters; a two-output head. (Activation checkpointing, BatchNorm, channels_last,
mixed dtypes and unequal batches have their own files.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.cases import get_case
from tests.engine.harness import (
    assert_close,
    build_engine,
    evaluate_engine,
    train_engine,
    train_reference,
    train_steps,
)
from tests.messages import assert_names


def _evaluate_between_steps(case_name: str, strategy: str) -> dict[str, Any]:
    engine = build_engine(case_name, strategy, optimizer="sgd")
    train_steps(engine, case_name, range(1))
    after_one = evaluate_engine(engine, case_name)
    with torch.no_grad():  # a no_grad forward in training mode too (e.g. logging a metric)
        engine(get_case(case_name).batch(0)[0])
    train_steps(engine, case_name, range(1, 3))
    out = {"after_one": after_one, "after_three": evaluate_engine(engine, case_name),
           "state": engine.full_state_dict()}
    engine.close()
    return out


def test_evaluation_between_steps_sees_the_trained_model_and_changes_nothing(pool, strategy: str) -> None:
    after_one = train_reference("tied", 1, optimizer="sgd")["eval"]
    want = train_reference("tied", 3, optimizer="sgd")
    for rank, result in enumerate(pool.run(_evaluate_between_steps, "tied", strategy)):
        assert_close({"eval": result["after_one"]}, {"eval": after_one}, f"rank {rank}: {strategy} eval after 1 step")
        assert_close({"eval": result["after_three"]}, {"eval": want["eval"]},
                     f"rank {rank}: {strategy} eval after 3 steps with evaluations in between")
        assert_close(result["state"], want["state"], f"rank {rank}: {strategy} training with evaluations between "
                     "steps against training without")


@pytest.mark.parametrize("case", ["repeated_block", "two_forwards", "frozen", "two_outputs"])
def test_user_model_pattern_trains_like_one_process(pool, strategy: str, case: str) -> None:
    """repeated_block: blocks[0] runs twice per forward; two_forwards: two forwards, one backward;
    frozen: the first layer has requires_grad=False on every rank (it must not move); two_outputs: a
    2-output head, whose bias is one element per rank on 2 ranks."""
    want = train_reference(case, 3, optimizer="sgd")
    for rank, result in enumerate(pool.run(train_engine, case, strategy, 3, optimizer="sgd", evaluate=True)):
        assert_close(result["state"], want["state"], f"rank {rank}: {case} under {strategy}")
        assert_close({"eval": result["eval"]}, {"eval": want["eval"]}, f"rank {rank}: {case} eval under {strategy}")
    if case == "frozen":
        initial = get_case(case).build().state_dict()
        for key in ("layers.0.weight", "layers.0.bias"):
            assert torch.equal(want["state"][key], initial[key])  # the reference itself froze them


def _unfreeze_after_construction(strategy: str) -> str:
    engine = build_engine("frozen", strategy, optimizer="sgd")
    train_steps(engine, "frozen", range(1))
    engine.module.layers[0].requires_grad_(True)  # a fine-tuning loop unfreezing its backbone
    try:
        train_steps(engine, "frozen", range(1, 2))
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        engine.close()


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_a_parameter_unfrozen_after_construction_is_an_error_not_ignored(pool, strategy: str) -> None:
    """The engine steps the parameters trainable when it was built; one unfrozen later got a gradient
    that nothing reduced or applied, and never trained, silently."""
    for message in pool.run(_unfreeze_after_construction, strategy):
        assert_names(message, "layers.0.weight", "requires_grad=False")
