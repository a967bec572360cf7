"""Activation checkpointing (finding 5 of issue 7), as users write it with ``torch.utils.checkpoint``:
inside a block or around whole blocks, reentrant or not. Under zero3 a checkpointed block recomputes its
forward during backward, which re-enters the block's gather hooks. Each form must train like one
process. A reentrant checkpoint over a block used twice runs one backward per use, so that block's
gradient arrives twice, possibly after its bucket was sent: the engine must count both halves, or say so
on every rank (as DDP does), never drop the second half silently."""

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

FORMS = ["checkpoint_inside_non_reentrant", "checkpoint_inside_reentrant", "checkpoint_unit_non_reentrant",
         "checkpoint_unit_reentrant", "repeated_block_non_reentrant"]


@pytest.mark.parametrize("form", FORMS)
def test_activation_checkpointing_trains_like_one_process(pool, strategy: str, form: str) -> None:
    want = train_reference(form, 3, optimizer="sgd")["state"]
    got = run_or_explain_hang(pool, train_engine, form, strategy, 3, optimizer="sgd", timeout_s=60,
                              hang_means=f"{form} under {strategy} left the ranks in different collectives")
    for rank, result in enumerate(got):
        assert_close(result["state"], want, f"rank {rank}: {form} under {strategy}")


def _train_and_report(case_name: str, strategy: str, bucket_mb: float) -> dict[str, Any]:
    try:
        state = train_engine(case_name, strategy, 2, optimizer="sgd", bucket_mb=bucket_mb)["state"]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "state": state}


@pytest.mark.parametrize("bucket_mb", [1e-4, 25.0])
def test_a_gradient_arriving_twice_trains_like_one_process_or_fails_on_every_rank(
        pool, strategy: str, bucket_mb: float) -> None:
    """Never silently wrong: either both halves of the gradient count (one-process parity), or every
    rank raises an error that names the parameter and says its gradient came more than once."""
    got = run_or_explain_hang(pool, _train_and_report, "repeated_block_reentrant", strategy, bucket_mb,
                              timeout_s=30, hang_means="a rank raised on the second gradient and its peer "
                                                       "kept waiting")
    errors = [result["error"] for result in got]
    if all(error is None for error in errors):
        want = train_reference("repeated_block_reentrant", 2, optimizer="sgd")["state"]
        for rank, result in enumerate(got):
            wrong = mismatches(result["state"], want)
            assert not wrong, (
                f"rank {rank}: under {strategy} (bucket_mb={bucket_mb}) a reentrant checkpoint over blocks[0] "
                f"(used twice) delivered its gradient twice; the engine raised nothing and {len(wrong)} tensors "
                f"differ from one process: {wrong[:2]}")
        return
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} trained on while its peer failed: {errors}"
        assert "blocks.0." in error, f"rank {rank}: the error must name the parameter: {error}"
        assert any(word in error for word in ("twice", "more than once", "reentrant")), (
            f"rank {rank}: the error must say the gradient arrived more than once: {error}")
