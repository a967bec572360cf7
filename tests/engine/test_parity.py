"""The core correctness proof: 2 ranks end with the same parameters as one process on the whole batch."""

from __future__ import annotations

import pytest
import torch

import dspark
from tests.engine import tiny_models as tm
from tests.engine.harness import assert_close, engine_state, parity, rel_error, train_reference


@pytest.mark.parametrize("model", ["mlp", "tied"])
def test_fp32_parity_with_single_process_pytorch(pool, strategy: str, model: str) -> None:
    for rank, result in enumerate(pool.run(parity, model, strategy)):
        assert result["error"] <= 1e-5, (rank, result["error"])


def test_gradient_accumulation_parity(pool, strategy: str) -> None:
    for result in pool.run(parity, "tied", strategy, accum=2):
        assert result["error"] <= 1e-5, result["error"]


def test_clipping_parity_uses_the_global_norm(pool, strategy: str) -> None:
    # clip well below the gradient norm so that clipping really acts on every step
    results = pool.run(parity, "mlp", strategy, clip=0.05)
    for result in results:
        assert result["error"] <= 1e-5, result["error"]
        assert all(n is not None and n > 0.05 for n in result["norms"]), result["norms"]
    assert results[0]["norms"] == pytest.approx(results[1]["norms"], rel=1e-6)


def _clip_in_the_loop(strategy: str, steps: int, optimizer: str) -> dict:
    """A loop that clips itself between backward and step (SGD: a wrong factor shows)."""
    from tests.engine.cases import get_case
    from tests.engine.harness import build_engine, micro_batches

    case = get_case("mlp")
    engine = build_engine("mlp", strategy, optimizer=optimizer, accum=2)
    norms = []
    for step in range(steps):
        for micro in micro_batches(case.batch(step), 2):
            engine.backward(case.loss(engine, dspark.distribute_batch(micro, shard_dim=0)))
        norms.append(engine.clip_grad_norm_(0.05))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return {"state": state, "norms": norms}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_clip_grad_norm_in_the_loop_matches_torch_clip_grad_norm(pool, strategy: str, optimizer: str) -> None:
    want = train_reference("mlp", 3, optimizer=optimizer, accum=2, clip=0.05)
    for result in pool.run(_clip_in_the_loop, strategy, 3, optimizer):
        assert result["norms"] == pytest.approx(want["norms"], rel=1e-6)  # clip_grad_norm_'s return
        assert all(n > 0.05 for n in result["norms"])  # it really clipped
        assert_close(result["state"], want["state"], f"{strategy} + {optimizer}: clip_grad_norm_ in the loop")


def test_clip_grad_norm_before_the_last_backward_is_refused(single_process) -> None:
    engine = dspark.Engine(tm.make("mlp"), optimizer=torch.optim.SGD, grad_accum_steps=2)
    x, y = tm.batch("mlp", 4, 0)
    engine.backward(tm.loss_fn("mlp", engine(x), y))
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) before the window's gradients are "
                       r"reduced \(1 of grad_accum_steps=2"):
        engine.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match=r"max_norm=0 must be a positive number"):
        engine.clip_grad_norm_(0)
    engine.close()


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
    # zero2's gradients travel by reduce-scatter; the step's small float64 vectors by all-reduce,
    # whatever the wire
    fp32 = pool.run(engine_state, "mlp", "zero2", 1)[0]["stats"]
    bf16 = pool.run(engine_state, "mlp", "zero2", 1, reduce_dtype=torch.bfloat16)[0]["stats"]
    assert fp32["reduce_scatter"][1] > 0 and bf16["reduce_scatter"][1] * 2 == fp32["reduce_scatter"][1]
    assert bf16["all_reduce"] == fp32["all_reduce"]
