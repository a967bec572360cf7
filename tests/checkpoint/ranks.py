"""Rank functions shared by the checkpoint tests (module-level, so the rank pool can run them).

Every function trains on this rank's slice of the same global batches as tests/engine/harness.py,
so a run at any world size and strategy follows the same trajectory up to float rounding.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any
from unittest import mock

import torch

import dspark
import dspark.checkpoint
from dspark.checkpoint import CheckpointSaveError
from dspark.engine.engine import engine_parts
from tests.engine import tiny_models as tm
from tests.engine.harness import GLOBAL_BATCH, LR

SAVED_STEPS = 2
"""Steps taken before the save; the test then compares one more step after it."""
SAVED_LR = LR / 2
"""The learning rate at the save, changed mid-run as a schedule would: a load must bring it back."""
SAVED_LOSS_SCALE = 2.0**10
"""An fp16 loss scale after some back-offs: a load must bring it back (the default is 2**16)."""


def make_engine(name: str, strategy: str, *, seed: int = 0, precision: str = "fp32") -> dspark.Engine:
    return dspark.Engine(tm.make(name, seed=seed), optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                         strategy=strategy, precision=precision, bucket_mb=1e-4)


def train(engine: dspark.Engine, name: str, steps: range) -> None:
    for step in steps:
        x, y = tm.batch(name, GLOBAL_BATCH, step)
        xl, yl = dspark.distribute_batch((x, y), shard_dim=0)
        engine.backward(tm.loss_fn(name, engine(xl), yl))
        if not engine.step():
            raise AssertionError(f"step {step} was skipped (fp16 overflow): the test needs every step")


def save_then_continue(path: str, name: str, strategy: str, *, precision: str = "fp32",
                       async_save: bool = False) -> dict[str, Any]:
    """Train SAVED_STEPS steps, save at ``path``, train one more: the state a resumed run must reach
    (with ``async_save``, that step runs while the checkpoint is written)."""
    engine = make_engine(name, strategy, precision=precision)
    train(engine, name, range(SAVED_STEPS))
    for group in engine.optimizer.param_groups:
        group["lr"] = SAVED_LR
    if engine.loss_scaler is not None:
        engine.loss_scaler.scale = SAVED_LOSS_SCALE
    engine.save(path, async_save=async_save)
    train(engine, name, range(SAVED_STEPS, SAVED_STEPS + 1))
    dspark.checkpoint.wait_for_pending_save()
    out = {"state": engine.full_state_dict(), "step_count": engine.step_count}
    engine.close()
    return out


def load_then_continue(path: str, name: str, strategy: str, *, precision: str = "fp32") -> dict[str, Any]:
    """A fresh engine (another initialisation, no optimizer step yet) loads ``path`` and takes the
    step after the save."""
    engine = make_engine(name, strategy, seed=1, precision=precision)
    info = engine.load(path)
    loaded = {"step_count": engine.step_count, "lr": engine.optimizer.param_groups[0]["lr"],
              "loss_scale": engine.loss_scale, "info": info,
              "optimizer_bytes": engine.memory_report()["optimizer_bytes"]}
    train(engine, name, range(SAVED_STEPS, SAVED_STEPS + 1))
    out = {**loaded, "state": engine.full_state_dict()}
    engine.close()
    return out


def save_with_failing_rank(path: str, failing_rank: int) -> str:
    """Train one step and save with ``failing_rank``'s shard write failing (a full disk, say);
    returns the error this rank raised."""
    import torch.distributed.checkpoint as dcp

    engine = make_engine("mlp", "zero2")
    train(engine, "mlp", range(1))

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device (simulated)")

    failing = dspark.get_world().rank == failing_rank
    patch = (mock.patch.object(dcp.FileSystemWriter, "write_data", disk_full) if failing
             else contextlib.nullcontext())
    try:
        with patch:
            engine.save(path)
    except CheckpointSaveError as exc:
        return str(exc)
    finally:
        engine.close()
    raise AssertionError("the save did not fail")


def load_error(path: str, name: str, strategy: str) -> tuple[str, str]:
    """Load ``path`` into a ``name`` engine; returns (error type, message) of what it raised."""
    return load_error_keeping_state(path, name, strategy)[:2]


def load_error_keeping_state(path: str, name: str, strategy: str) -> tuple[str, str, bool]:
    """Load ``path`` into a ``name`` engine; returns (error type, message, whether the engine's
    parameters, buffers and optimizer state are all exactly as before the load)."""
    engine = make_engine(name, strategy)
    train(engine, name, range(1))
    before = snapshot(engine)
    try:
        engine.load(path)
    except Exception as exc:
        after = snapshot(engine)
        same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        return type(exc).__name__, str(exc), same and engine.step_count == 1
    finally:
        engine.close()
    raise AssertionError("the load did not fail")


def snapshot(engine: dspark.Engine) -> dict[str, torch.Tensor]:
    # the engine's own walk: under zero3 the module refuses state_dict() while its parameters are
    # freed (their shards are compared below)
    states = engine_parts(engine).states
    tensors = {f"model/{k}": v.detach().clone() for k, v in states.module_state_dict().items()}
    for slot in engine.slots:
        param = slot.opt_param if engine.strategy.shard_optimizer else slot.param
        for key, value in engine.optimizer.state.get(param, {}).items() if param is not None else ():
            tensors[f"optim/{slot.name}/{key}"] = value.detach().clone()
    tensors.update({f"shard/{s.name}": s.padded_shard.clone() for s in engine.slots
                    if s.padded_shard is not None})
    return tensors


def save_at_steps(paths_by_step: dict[int, str], name: str = "mlp", strategy: str = "zero3") -> dict[int, float]:
    """One run that saves at each step given (``{3: ".../a", 5: ".../b"}``); returns a checksum of
    the model at each save (the sum of its parameters)."""
    engine = make_engine(name, strategy)
    sums, done = {}, 0
    for step, path in sorted(paths_by_step.items()):
        train(engine, name, range(done, step))
        done = step
        engine.save(path)
        sums[step] = float(sum(p.double().sum() for p in engine.full_state_dict().values()))
    engine.close()
    return sums


def load_checksum(path: str, name: str = "mlp", strategy: str = "zero3", *,
                  verify: bool = True) -> tuple[int, float]:
    """Load ``path`` into a fresh engine: (its step count, the checksum :func:`save_at_steps` gives)."""
    engine = make_engine(name, strategy, seed=1)
    engine.load(path, verify=verify)
    out = (engine.step_count, float(sum(p.double().sum() for p in engine.full_state_dict().values())))
    engine.close()
    return out
