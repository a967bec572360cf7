"""fp16: an overflow on any rank skips the step everywhere and leaves the state untouched."""

from __future__ import annotations

import functools

import pytest
import torch

import dspark
from dspark.engine import LossScaler
from tests.engine import tiny_models as tm
from tests.engine.harness import with_deferred_host_reads


def test_loss_scaler_backs_off_and_grows() -> None:
    scaler = LossScaler(scale=1024.0, growth_interval=2)
    scaler.update(found_overflow=True)
    assert scaler.scale == 512.0
    scaler.update(found_overflow=False)
    assert scaler.scale == 512.0
    scaler.update(found_overflow=False)
    assert scaler.scale == 1024.0


@pytest.mark.parametrize("bad", [{"scale": 0.0}, {"growth_factor": 1.0}, {"backoff_factor": 1.5},
                                 {"growth_interval": 0}])
def test_loss_scaler_rejects_bad_settings(bad: dict) -> None:
    with pytest.raises(ValueError):
        LossScaler(**bad)


def _overflow_on_rank_1(strategy: str) -> dict:
    world = dspark.get_world()
    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy, precision="fp16",
                           loss_scaler=LossScaler(scale=2.0**10, growth_interval=2))

    def train_step(poison: bool) -> bool:
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, 0), shard_dim=0)
        loss = tm.loss_fn("mlp", engine(x), y)
        if poison and world.rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        return engine.step()

    assert train_step(poison=False)
    params_before = engine.full_state_dict()
    opt_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in engine.optimizer.state.items()}
    scale_before = engine.loss_scale
    applied = train_step(poison=True)
    norm_after_skip = engine.last_grad_norm
    params_after = engine.full_state_dict()
    unchanged = all(torch.equal(params_before[k], params_after[k]) for k in params_before)
    opt_unchanged = all(torch.equal(opt_before[id(p)][k], v)
                        for p, s in engine.optimizer.state.items() for k, v in s.items())
    scale_after_skip = engine.loss_scale
    good = [train_step(poison=False) for _ in range(2)]
    result = {"applied": applied, "unchanged": unchanged, "opt_unchanged": opt_unchanged,
              "scales": (scale_before, scale_after_skip, engine.loss_scale), "good": good,
              "norm_after_skip": norm_after_skip, "norm_after_good": engine.last_grad_norm}
    engine.close()
    return result


@pytest.mark.parametrize("order", ["host_decides", "device_skips"])
def test_overflow_skips_the_step_on_every_rank(pool, strategy: str, order: str) -> None:
    # device_skips: a GPU's order (the fused AdamW's found_inf skips the update, the host reads the
    # norm afterwards), run on these CPU ranks
    task = (_overflow_on_rank_1 if order == "host_decides"
            else functools.partial(with_deferred_host_reads, _overflow_on_rank_1))
    for result in pool.run(task, strategy):
        assert result["applied"] is False
        assert result["unchanged"] and result["opt_unchanged"]
        before, after_skip, after_growth = result["scales"]
        assert after_skip == before / 2
        assert result["good"] == [True, True]
        assert after_growth == before  # grew back after growth_interval good steps
        # the overflow is the reduction's non-finite flag: no norm is measured without clipping
        assert result["norm_after_skip"] is None and result["norm_after_good"] is None, result
