"""``save_checkpoint``: every rank writes its shards of an engine's state through DCP into a hidden
sibling directory, which rank 0 publishes at ``path`` once every rank has succeeded (see
[Note: atomic save] in :mod:`dspark.checkpoint.atomic` and [Note: checkpoint layout] in
:mod:`dspark.checkpoint.layout`); with ``async_save`` the writing happens in the background
([Note: asynchronous save] in :mod:`dspark.checkpoint.background`).

[Note: a failed save fails on every rank] Each step that can fail on one rank alone (rank 0
preparing the directory, a rank that cannot see or write it, building the state, DCP's writes, the
JSON files, the publication) is followed by an agreement before the next collective: every rank
learns whether any rank failed, and all raise the same :class:`CheckpointSaveError` naming the
failed ranks. No rank is left waiting in a collective that the others skipped.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark import comm
from dspark._version import __version__
from dspark.checkpoint import background, json_values, layout, storage
from dspark.checkpoint.atomic import claim, publish, remove_stale, staging_dir
from dspark.checkpoint.errors import CheckpointSaveError
from dspark.checkpoint.info import INFO_FILE, CheckpointInfo, write_info
from dspark.checkpoint.shards import for_dcp
from dspark.checkpoint.training_state import TrainingState, write_training_state

if TYPE_CHECKING:
    from dspark.engine import Engine

__all__ = ["engine_state", "save_checkpoint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """Everything the writing half of a save needs, taken from the engine at the save's step."""

    state: dict[str, Any]
    training: TrainingState
    info: CheckpointInfo
    final: Path
    staging: Path
    token: str
    distributed: bool


def save_checkpoint(engine: Engine, path: str | os.PathLike[str], *, async_save: bool = False) -> Path:
    """Save ``engine``'s model, optimizer and training state as a sharded checkpoint directory at
    ``path``, replacing the checkpoint there only once the new one is complete. Collective: every
    rank calls it, between steps. ``path`` must be on a file system every rank sees.

    ``async_save=True`` returns once the state is copied into CPU memory; the copy is written and
    published in the background (wait with :func:`~dspark.checkpoint.wait_for_pending_save`; the
    next save, a load and ``dspark.shutdown()`` wait by themselves). Returns the checkpoint's path.

    Example::

        save_checkpoint(engine, "ckpt/latest")   # what engine.save("ckpt/latest") does
    """
    background.wait_for_pending_save()  # one save at a time; raises the previous one's failure
    world = engine.world
    final = _absolute(path)
    token, problem, is_user_error = comm.broadcast_object(_prepare(final) if world.rank == 0 else None)
    if problem is not None:
        if is_user_error:
            raise ValueError(f"rank {world.rank}: {problem}")
        raise CheckpointSaveError(f"rank {world.rank}: saving checkpoint {str(final)!r} failed on "
                                  f"rank(s) [0]: {problem}", failed_ranks=(0,))
    staging = staging_dir(final, token)

    failure: BaseException | None = None
    try:
        _check_can_write(staging)
    except Exception as exc:  # a rank that does not share the file system, or may not write there
        failure = exc
    _raise_if_any_failed(world.rank, failure, final, staging, comm.default_group())
    _equalize_buffers(engine)
    try:
        state = engine_state(engine)
        training, my_values = _training_state(engine)
        if async_save:
            state = storage.stage_on_cpu(state)
    except Exception as exc:  # agreed on below, so that no rank enters DCP's collectives alone
        failure = exc
    _raise_if_any_failed(world.rank, failure, final, staging, comm.default_group())
    job = _Job(state=state, training=_with_everyones_values(training, my_values),
               info=checkpoint_info(engine), final=final, staging=staging, token=token,
               distributed=world.is_distributed)
    if not async_save:
        return _write_and_publish(job, comm.default_group())
    group = background.side_group()
    background.submit(final, lambda: _write_and_publish(job, group))
    log.info("rank %d: checkpoint %s at step %d staged, writing in the background", world.rank,
             final, engine.step_count)
    return final


def _absolute(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path).absolute()


def _prepare(final: Path) -> tuple[str, str | None, bool]:
    """Rank 0: refuse to replace what is not a checkpoint, clear stale temporaries, create the
    staging directory. Returns (token, problem or None, whether the problem is the caller's) for
    every rank."""
    token = uuid.uuid4().hex[:12]
    try:
        if final.exists() and not ((final / INFO_FILE).is_file() or
                                   (final.is_dir() and not any(final.iterdir()))):
            return token, (f"path={str(final)!r} exists and is not a DSpark checkpoint; engine.save "
                           "replaces only a checkpoint or an empty directory (choose another path)"), True
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final)
        claim(staging_dir(final, token))
    except OSError as exc:  # reported to every rank, which all raise: none waits for the others
        return token, f"cannot write a checkpoint at {str(final)!r}: {type(exc).__name__}: {exc}", False
    return token, None, False


def _check_can_write(staging: Path) -> None:
    """Every rank: the staging directory rank 0 created is visible here and writable."""
    if not staging.is_dir():
        raise FileNotFoundError(f"{str(staging)!r}, created by rank 0, is not visible on this rank: "
                                "the checkpoint path must be on a file system every rank shares")
    if not os.access(staging, os.W_OK | os.X_OK):
        raise PermissionError(f"this rank may not write into {str(staging)!r}")


def _raise_if_any_failed(rank: int, failure: BaseException | None, final: Path, staging: Path,
                         group: comm.Group) -> None:
    """Collective over ``group``: every rank learns whether any rank failed; if so all raise, and
    the staging directory is removed, so the checkpoint at ``final`` stays as it was."""
    mine = None
    if failure is not None:
        # DCP reports every rank's failure on every rank; name the ranks where it happened
        ranks = getattr(failure, "failed_ranks", ()) or (rank,)
        mine = (list(ranks), f"{type(failure).__name__}: {failure}")
        log.error("rank %d: checkpoint save failed: %s", rank, mine[1])
    reports = [r for r in comm.all_gather_object(mine, group=group) if r is not None]
    if not reports:
        return
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    comm.barrier(group=group)  # nobody returns (and perhaps retries) before the staging dir is gone
    failed_ranks = tuple(sorted({r for ranks, _ in reports for r in ranks}))
    detail = reports[0][1][:600]
    raise CheckpointSaveError(
        f"rank {rank}: saving checkpoint {str(final)!r} failed on rank(s) {list(failed_ranks)}: "
        f"{detail}. Nothing was published: the checkpoint previously at that path, if any, is "
        "untouched", failed_ranks=failed_ranks) from failure


def _write_and_publish(job: _Job, group: comm.Group) -> Path:
    """The writing half of a save, on every rank of ``group`` (the default group, or the background
    thread's own): DCP's files, rank 0's JSON files, then rank 0 publishes."""
    rank = group.rank
    failure: BaseException | None = None
    try:
        storage.write_state(job.state, job.staging, distributed=job.distributed, process_group=group.pg)
        if rank == 0:
            write_training_state(job.staging, job.training)
            write_info(job.staging, job.info)
    except Exception as exc:
        failure = exc
    _raise_if_any_failed(rank, failure, job.final, job.staging, group)

    problem: str | None = None
    if rank == 0:
        try:
            publish(job.staging, job.final, job.token)
        except OSError as exc:
            shutil.rmtree(job.staging, ignore_errors=True)
            problem = f"{type(exc).__name__}: {exc}"
    problem = comm.broadcast_object(problem, group=group)
    if problem is not None:
        raise CheckpointSaveError(f"rank {rank}: checkpoint {str(job.final)!r} was written but could "
                                  f"not be put in place on rank 0: {problem}. The checkpoint previously "
                                  "at that path, if any, is untouched", failed_ranks=(0,))
    log.info("rank %d: saved checkpoint %s at step %d", rank, job.final, job.training.step_count)
    return job.final


def _equalize_buffers(engine: Engine) -> None:
    """Give every rank rank 0's persistent buffers (BatchNorm's running statistics drift apart when
    each rank normalises its own slice of the batch), so the one copy saved is what every rank
    holds. Collective."""
    persistent = engine.module.state_dict(keep_vars=True)
    for name, buffer in engine.module.named_buffers():
        if name not in persistent:  # a non-persistent buffer is not part of the model's state
            continue
        if buffer.is_contiguous():
            comm.broadcast(buffer.data, src=0)
        else:
            flat = buffer.detach().contiguous()
            comm.broadcast(flat, src=0)
            buffer.data.copy_(flat)


def engine_state(engine: Engine) -> dict[str, torch.Tensor]:
    """The flat tensor state dict DCP saves for ``engine`` on this rank (see [Note: checkpoint
    layout]): this rank's shards as DTensors, replicated tensors as they are, and (rank 0 only)
    frozen parameters and buffers.

    Example::

        sorted(engine_state(engine))[:2]   # ['model/layers.0.bias', 'model/layers.0.weight']
    """
    sharded = engine.strategy.shard_optimizer
    state: dict[str, torch.Tensor] = {}
    trainable_names: set[str] = set()
    for slot in engine.slots:
        trainable_names.update(slot.names)
        global_rows = layout.rows_shape(slot.shape)
        if sharded:
            if slot.opt_param is None:
                raise AssertionError(f"{slot.name}: a sharded strategy without a shard")
            local = slot.opt_param.detach()  # (local_rows, *rest): zero1/2 a view of the full param
        else:
            local = slot.rows_view(slot.param.detach())
        state[layout.model_key(slot.name)] = for_dcp(local, global_rows, sharded=sharded)
    if engine.world.rank == 0:  # whole and equal on every rank: saved once, from the agreed rank
        for name, tensor in engine.module.state_dict(keep_vars=True).items():
            if name not in trainable_names:
                state[layout.model_key(name)] = tensor.detach()

    optimizer = engine.optimizer
    for slot in engine.slots:
        param = slot.opt_param if sharded else slot.param
        if param is None or param not in optimizer.state:  # an empty shard, or no step yet
            continue
        global_rows = layout.rows_shape(slot.shape)
        for key, value in optimizer.state[param].items():
            if not isinstance(value, torch.Tensor):
                continue  # JSON, in training_state.json (see _training_state)
            entry = layout.optim_key(slot.name, str(key))
            if layout.is_per_element(str(key), value.shape, param.shape):
                local = value.detach().reshape(slot.opt_shape if sharded else global_rows)
                state[entry] = for_dcp(local, global_rows, sharded=sharded)
            else:
                state[entry] = value.detach()
    return state


def _training_state(engine: Engine) -> tuple[TrainingState, dict[str, dict[str, Any]]]:
    """This rank's non-tensor state, checked to be JSON-able here so that a bad value fails before
    any file is written; and its non-tensor optimizer values by parameter name."""
    optimizer = engine.optimizer
    # copies: a background save writes them while a scheduler changes the live ones
    groups = [copy.deepcopy({k: v for k, v in group.items() if k != "params"})
              for group in optimizer.param_groups]
    for i, group in enumerate(groups):
        json_values.encode(group, f"optimizer param_groups[{i}]")
    values: dict[str, dict[str, Any]] = {}
    for slot in engine.slots:
        param = slot.opt_param if engine.strategy.shard_optimizer else slot.param
        if param is None or param not in optimizer.state:
            continue
        plain = {str(k): v for k, v in optimizer.state[param].items() if not isinstance(v, torch.Tensor)}
        if plain:
            json_values.encode(plain, f"optimizer state of {slot.name!r}")
            values[slot.name] = copy.deepcopy(plain)
    scaler = engine.loss_scaler
    training = TrainingState(step_count=engine.step_count,
                             loss_scale=None if scaler is None else float(scaler.scale),
                             loss_scale_good_steps=None if scaler is None else int(scaler.good_steps),
                             param_groups=groups)
    return training, values


def _with_everyones_values(training: TrainingState, mine: dict[str, dict[str, Any]]) -> TrainingState:
    """``training`` with every rank's non-tensor optimizer values (a rank holding no rows of a
    parameter has none of its state; rank 0 writes the file). Collective."""
    merged: dict[str, dict[str, Any]] = {}
    for theirs in comm.all_gather_object(mine):
        for name, values in theirs.items():
            merged.setdefault(name, values)
    return TrainingState(step_count=training.step_count, loss_scale=training.loss_scale,
                         loss_scale_good_steps=training.loss_scale_good_steps,
                         param_groups=training.param_groups, optimizer_values=merged)


def checkpoint_info(engine: Engine) -> CheckpointInfo:
    """The human-readable description written next to the shards (``dspark.json``).

    Example::

        checkpoint_info(engine).num_params   # 91
    """
    return CheckpointInfo(
        step_count=engine.step_count,
        strategy=engine.strategy.name,
        precision=engine.precision.name,
        world_size=engine.world.world_size,
        optimizer=type(engine.optimizer).__name__,
        num_param_groups=len(engine.optimizer.param_groups),
        num_params=sum(slot.numel for slot in engine.slots),
        params={slot.name: list(layout.rows_shape(slot.shape)) for slot in engine.slots},
        dspark_version=__version__,
        torch_version=torch.__version__,
        created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )
