"""The core correctness proof: 2 ranks end with the same parameters as one process on the whole batch."""

from __future__ import annotations

import pytest
import torch

from tests.engine import tiny_models as tm
from tests.engine.harness import engine_state, parity, rel_error

STRATEGIES = ["replicate", "zero1", "zero2", "zero3"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model", ["mlp", "tied"])
def test_fp32_parity_with_single_process_pytorch(pool, strategy: str, model: str) -> None:
    for rank, result in enumerate(pool.run(parity, model, strategy)):
        assert result["error"] <= 1e-5, (rank, result["error"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_parity(pool, strategy: str) -> None:
    for result in pool.run(parity, "tied", strategy, accum=2):
        assert result["error"] <= 1e-5, result["error"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clipping_parity_uses_the_global_norm(pool, strategy: str) -> None:
    # clip well below the gradient norm so that clipping really acts on every step
    results = pool.run(parity, "mlp", strategy, clip=0.05)
    for result in results:
        assert result["error"] <= 1e-5, result["error"]
        assert all(n is not None and n > 0.05 for n in result["norms"]), result["norms"]
    assert results[0]["norms"] == pytest.approx(results[1]["norms"], rel=1e-6)


def _accumulation_sends_nothing_early() -> dict:
    from tests.engine.harness import engine_state

    return engine_state("mlp", "zero2", 1, accum=4)["stats"]


def test_no_communication_on_non_final_micro_steps(pool) -> None:
    accumulated = pool.run(_accumulation_sends_nothing_early)[0]
    single = pool.run(engine_state, "mlp", "zero2", 1)[0]["stats"]
    assert accumulated["all_reduce"] == single["all_reduce"]


@pytest.mark.parametrize("precision,tolerance", [("bf16", 2e-2), ("fp16", 2e-3)])
@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_mixed_precision_matches_the_one_rank_engine(pool, single_process, strategy: str,
                                                      precision: str, tolerance: float) -> None:
    """bf16/fp16 round differently when each rank sees half the batch; the stated tolerance is the
    relative parameter error after 3 AdamW steps (bf16 keeps 8 mantissa bits, fp16 11)."""
    one_rank = engine_state("tied", strategy, 3, precision=precision)["state"]
    for result in pool.run(engine_state, "tied", strategy, 3, precision=precision):
        assert rel_error(result["state"], one_rank) <= tolerance


def test_ranks_end_with_identical_parameters(pool) -> None:
    a, b = pool.run(engine_state, "tied", "zero3", 2, precision="bf16")
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key


def test_bf16_wire_halves_reduce_bytes(pool) -> None:
    fp32 = pool.run(engine_state, "mlp", "zero2", 1)[0]["stats"]["all_reduce"]
    bf16 = pool.run(engine_state, "mlp", "zero2", 1, reduce_dtype=torch.bfloat16)
    extras = 8 * (2 + 2 + len(list(tm.make("mlp").parameters())))  # float64 whatever the wire
    assert (bf16[0]["stats"]["all_reduce"][1] - extras) * 2 == fp32[1] - extras
