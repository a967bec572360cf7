"""Everything a loop needs comes back from a checkpoint: an LR scheduler and other objects passed as
``extra=``, random states, param groups' hyper-parameters and the step, also at another world size
and strategy."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dspark
from dspark.checkpoint import CheckpointError
from tests.engine import loop_models as lm
from tests.messages import assert_names

ADAMW = functools.partial(torch.optim.AdamW, lr=2e-2, weight_decay=0.1)
TOTAL_STEPS = 6
SAVE_AT = 3


def _engine(strategy: str) -> tuple[dspark.Engine, torch.optim.lr_scheduler.LambdaLR]:
    engine = dspark.Engine(lm.build(), optimizer=ADAMW, strategy=strategy, param_groups=lm.nanogpt_groups)
    return engine, torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lm.warmup_cosine)


def _steps(engine: dspark.Engine, scheduler: Any, first: int, last: int) -> None:
    for step in range(first, last):
        x, y = dspark.distribute_batch(lm.batch(step), shard_dim=0)
        engine.backward(lm.loss_fn(engine(x), y))
        engine.step()
        scheduler.step()


def _train_and_save(directory: str) -> dict[str, Any]:
    engine, scheduler = _engine("zero3")
    _steps(engine, scheduler, 0, SAVE_AT)
    counters = {"tokens_seen": 1234, "best": float("inf"), "history": [1.5, (2, 3)]}
    ema = {"weight": torch.arange(6.0).reshape(2, 3)}  # a tensor inside an extra state
    torch.manual_seed(99 + dspark.get_world().rank)
    random.seed(7)
    np.random.seed(8)
    engine.save(directory, extra={"scheduler": scheduler, "counters": counters, "ema": ema})
    draws = (torch.rand(3), random.random(), float(np.random.rand()))
    engine.close()
    return {"draws": draws}


def _resume(directory: str, strategy: str) -> dict[str, Any]:
    engine, scheduler = _engine(strategy)
    counters: dict[str, Any] = {}
    ema: dict[str, Any] = {}
    info = engine.load(directory, extra={"scheduler": scheduler, "counters": counters, "ema": ema})
    draws = (torch.rand(3), random.random(), float(np.random.rand()))
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    decay = [g["weight_decay"] for g in engine.optimizer.param_groups]
    _steps(engine, scheduler, SAVE_AT, TOTAL_STEPS)
    state = engine.full_state_dict()
    engine.close()
    return {"info_step": info.step_count, "step": scheduler.last_epoch, "counters": counters, "ema": ema,
            "draws": draws, "lrs": lrs, "decay": decay, "state": state}


def test_groups_scheduler_and_extras_resume_from_2_ranks_zero3_on_1_rank_replicate(
        pool, single_process, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = pool.run(_train_and_save, directory)
    uninterrupted = lm.reference(TOTAL_STEPS, ADAMW, groups=True, schedule=True)
    resumed = _resume(directory, "replicate")
    assert resumed["info_step"] == SAVE_AT and resumed["step"] == TOTAL_STEPS
    assert lm.max_rel_error(resumed["state"], uninterrupted) <= 2e-5
    assert resumed["lrs"] == pytest.approx([ADAMW.keywords["lr"] * lm.warmup_cosine(SAVE_AT)] * 2)
    assert resumed["decay"] == [0.1, 0.0]
    assert resumed["counters"] == {"tokens_seen": 1234, "best": float("inf"), "history": [1.5, (2, 3)]}
    assert torch.equal(resumed["ema"]["weight"], torch.arange(6.0).reshape(2, 3))
    # rank 0's random streams continue exactly where they were at the save
    assert torch.equal(resumed["draws"][0], saved[0]["draws"][0])
    assert resumed["draws"][1:] == saved[0]["draws"][1:]


def test_resuming_on_2_ranks_zero1_continues_like_the_uninterrupted_run(pool, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = pool.run(_train_and_save, directory)
    uninterrupted = lm.reference(TOTAL_STEPS, ADAMW, groups=True, schedule=True)
    for rank, result in enumerate(pool.run(_resume, directory, "zero1")):
        assert lm.max_rel_error(result["state"], uninterrupted) <= 2e-5
        assert torch.equal(result["draws"][0], saved[rank]["draws"][0])  # each rank's own stream


def test_an_extra_the_checkpoint_lacks_is_an_error_before_anything_changes(single_process,
                                                                         tmp_path: Path) -> None:
    engine, scheduler = _engine("replicate")
    _steps(engine, scheduler, 0, 1)
    engine.save(tmp_path / "ckpt", extra={"scheduler": scheduler})
    with pytest.raises(CheckpointError) as caught:
        engine.load(tmp_path / "ckpt", extra={"loader": {}})
    assert_names(str(caught.value), "['loader']", "['scheduler']")
    with pytest.raises(TypeError) as caught:
        engine.save(tmp_path / "ckpt2", extra={"bad": object()})
    assert_names(str(caught.value), "extra['bad']", "object")


def test_every_stock_scheduler_with_state_round_trips(single_process, tmp_path: Path) -> None:
    """MultiStepLR's milestones are a Counter with int keys: refused by a JSON-only checkpoint until
    dicts with other keys were stored as pairs. Each scheduler resumes where it was, stepping on."""
    sched = torch.optim.lr_scheduler
    makers = {
        "multistep": lambda o: sched.MultiStepLR(o, milestones=[2, 4], gamma=0.5),
        "step": lambda o: sched.StepLR(o, step_size=2),
        "plateau": lambda o: sched.ReduceLROnPlateau(o, patience=0),
        "cyclic": lambda o: sched.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
        "sequential": lambda o: sched.SequentialLR(o, [sched.ConstantLR(o, factor=0.5, total_iters=2),
                                                       sched.ExponentialLR(o, gamma=0.9)], milestones=[2]),
    }
    for name, make in makers.items():
        lrs = []
        for resume in (False, True):
            engine = dspark.Engine(lm.build(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
            scheduler = make(engine.optimizer)
            if resume:
                engine.load(tmp_path / name, extra={"scheduler": scheduler})
            for step in range(3):
                x, y = dspark.distribute_batch(lm.batch(step), shard_dim=0)
                engine.backward(lm.loss_fn(engine(x), y))
                engine.step()
                scheduler.step(1.0) if name == "plateau" else scheduler.step()
                lrs.append(engine.optimizer.param_groups[0]["lr"])
            if not resume:
                engine.save(tmp_path / name, extra={"scheduler": scheduler})
            engine.close()
        uninterrupted = []
        engine = dspark.Engine(lm.build(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        scheduler = make(engine.optimizer)
        for step in range(6):
            x, y = dspark.distribute_batch(lm.batch(step % 3), shard_dim=0)
            engine.backward(lm.loss_fn(engine(x), y))
            engine.step()
            scheduler.step(1.0) if name == "plateau" else scheduler.step()
            uninterrupted.append(engine.optimizer.param_groups[0]["lr"])
        engine.close()
        assert lrs == pytest.approx(uninterrupted), name
