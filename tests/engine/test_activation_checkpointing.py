"""Activation checkpointing (finding 5 of issue 7), as users write it with ``torch.utils.checkpoint``:
inside a block or around whole blocks, reentrant or not. Under zero3 a checkpointed block recomputes its
forward during backward, which re-enters the block's gather hooks. Each form must train like one
process. A reentrant checkpoint over a block used twice runs one backward per use, so that block's
gradient arrives twice, after its bucket was sent: the engine must say so (as DDP does), on every rank,
rather than drop the second half of the gradient."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.harness import (
    assert_close,
    mismatches,
    run_or_explain_hang,
    train_engine,
    train_reference,
)

STRATEGIES = ["replicate", "zero1", "zero2", "zero3"]
FORMS = ["checkpoint_inside_non_reentrant", "checkpoint_inside_reentrant", "checkpoint_unit_non_reentrant",
         "checkpoint_unit_reentrant", "repeated_block_non_reentrant"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_activation_checkpointing_trains_like_one_process(pool, strategy: str, form: str) -> None:
    want = train_reference(form, 3, optimizer="sgd")["state"]
    got = run_or_explain_hang(pool, train_engine, form, strategy, 3, optimizer="sgd", timeout_s=60,
                              hang_means=f"{form} under {strategy} left the ranks in different collectives")
    for rank, result in enumerate(got):
        assert_close(result["state"], want, f"rank {rank}: {form} under {strategy}")


def _train_and_report(case_name: str, strategy: str) -> dict[str, Any]:
    try:
        return {"error": None, "state": train_engine(case_name, strategy, 2, optimizer="sgd")["state"]}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_arriving_twice_is_an_error_on_every_rank(pool, strategy: str) -> None:
    got = run_or_explain_hang(pool, _train_and_report, "repeated_block_reentrant", strategy, timeout_s=30,
                              hang_means="a rank raised on the second gradient and its peer kept waiting")
    want = train_reference("repeated_block_reentrant", 2, optimizer="sgd")["state"]
    for rank, result in enumerate(got):
        if result["error"] is None:
            wrong = mismatches(result["state"], want)
            raise AssertionError(
                f"rank {rank}: under {strategy} a reentrant checkpoint over blocks[0] (used twice) delivered "
                f"its gradient twice and the engine raised nothing; {len(wrong)} tensors then differ from one "
                f"process: {wrong[:2]}")
        assert "blocks.0." in result["error"], f"rank {rank}: the error must name the parameter: {result['error']}"
        assert any(word in result["error"] for word in ("twice", "more than once", "reentrant")), (
            f"rank {rank}: the error must say the gradient arrived more than once: {result['error']}")
