"""``save_checkpoint``: every rank writes its shards of an engine's state through DCP into a hidden
sibling directory, which rank 0 publishes at ``path`` once every rank has succeeded (see
[Note: atomic save] in :mod:`dspark.checkpoint.atomic` and [Note: checkpoint layout] in
:mod:`dspark.checkpoint.layout`)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark import comm
from dspark._version import __version__
from dspark.checkpoint import layout, storage
from dspark.checkpoint.atomic import publish, remove_stale, staging_dir
from dspark.checkpoint.errors import CheckpointSaveError
from dspark.checkpoint.info import INFO_FILE, CheckpointInfo, write_info
from dspark.checkpoint.shards import for_dcp

if TYPE_CHECKING:
    from dspark.engine import Engine

__all__ = ["engine_state", "save_checkpoint"]

log = logging.getLogger(__name__)


def save_checkpoint(engine: Engine, path: str | os.PathLike[str]) -> Path:
    """Save ``engine``'s model, optimizer and training state as a sharded checkpoint directory at
    ``path``, replacing the checkpoint there only once the new one is complete. Collective: every
    rank calls it, between steps. ``path`` must be on a file system every rank sees.

    Example::

        save_checkpoint(engine, "ckpt/latest")   # what engine.save("ckpt/latest") does
    """
    world = engine.world
    final = _absolute(path)
    token, problem = comm.broadcast_object(_prepare(final) if world.rank == 0 else None)
    if problem is not None:
        raise ValueError(f"rank {world.rank}: {problem}")
    staging = staging_dir(final, token)

    failure: BaseException | None = None
    try:
        state = engine_state(engine)
    except Exception as exc:  # agreed on below, so that no rank enters DCP's collectives alone
        failure = exc
    _raise_if_any_failed(world.rank, failure, final, staging)
    try:
        storage.write_state(state, staging, distributed=world.is_distributed)
        if world.rank == 0:
            write_info(staging, checkpoint_info(engine))
    except Exception as exc:
        failure = exc
    _raise_if_any_failed(world.rank, failure, final, staging)

    published: str | None = None
    if world.rank == 0:
        try:
            publish(staging, final, token)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            published = f"{type(exc).__name__}: {exc}"
    published = comm.broadcast_object(published)
    if published is not None:
        raise CheckpointSaveError(f"rank {world.rank}: checkpoint {str(final)!r} was written but could "
                                  f"not be put in place: {published}")
    log.info("rank %d: saved checkpoint %s at step %d", world.rank, final, engine.step_count)
    return final


def _absolute(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path).absolute()


def _prepare(final: Path) -> tuple[str, str | None]:
    """Rank 0: refuse to replace what is not a checkpoint, clear stale temporaries, create the
    staging directory. Returns (token, problem or None) for every rank."""
    token = uuid.uuid4().hex[:12]
    if final.exists() and not ((final / INFO_FILE).is_file() or
                               (final.is_dir() and not any(final.iterdir()))):
        return token, (f"path={str(final)!r} exists and is not a DSpark checkpoint; engine.save "
                       "replaces only a checkpoint or an empty directory (choose another path)")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final)
        staging_dir(final, token).mkdir()
    except OSError as exc:  # reported to every rank, which all raise: none waits for the others
        return token, f"cannot write a checkpoint at {str(final)!r}: {type(exc).__name__}: {exc}"
    return token, None


def _raise_if_any_failed(rank: int, failure: BaseException | None, final: Path, staging: Path) -> None:
    """Collective: every rank learns whether any rank failed; if so all raise, and the staging
    directory is removed, so the checkpoint at ``final`` stays as it was."""
    mine = None
    if failure is not None:
        # DCP reports every rank's failure on every rank; name the ranks where it happened
        ranks = getattr(failure, "failed_ranks", ()) or (rank,)
        mine = (list(ranks), f"{type(failure).__name__}: {failure}")
        log.error("rank %d: checkpoint save failed: %s", rank, mine[1])
    reports = [r for r in comm.all_gather_object(mine) if r is not None]
    if not reports:
        return
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    comm.barrier()  # nobody returns (and perhaps retries) before the staging directory is gone
    failed_ranks = tuple(sorted({r for ranks, _ in reports for r in ranks}))
    detail = reports[0][1][:600]
    raise CheckpointSaveError(
        f"rank {rank}: saving checkpoint {str(final)!r} failed on rank(s) {list(failed_ranks)}: "
        f"{detail}. Nothing was published: the checkpoint previously at that path, if any, is "
        "untouched", failed_ranks=failed_ranks) from failure


def engine_state(engine: Engine) -> dict[str, Any]:
    """The flat state dict DCP saves for ``engine`` on this rank (see [Note: checkpoint layout]):
    this rank's shards as DTensors, replicated tensors and values as they are.

    Example::

        sorted(engine_state(engine))[:2]   # ['engine/step_count', 'model/layers.0.bias']
    """
    sharded = engine.strategy.shard_optimizer
    state: dict[str, Any] = {}
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
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if name not in trainable_names:  # frozen parameters and persistent buffers: whole everywhere
            state[layout.model_key(name)] = tensor.detach()

    optimizer = engine.optimizer
    for slot in engine.slots:
        param = slot.opt_param if sharded else slot.param
        if param is None or param not in optimizer.state:  # an empty shard, or no step yet
            continue
        global_rows = layout.rows_shape(slot.shape)
        for key, value in optimizer.state[param].items():
            entry = layout.optim_key(slot.name, str(key))
            if isinstance(value, torch.Tensor) and layout.is_per_element(str(key), value.shape, param.shape):
                local = value.detach().reshape(slot.opt_shape if sharded else global_rows)
                state[entry] = for_dcp(local, global_rows, sharded=sharded)
            elif isinstance(value, torch.Tensor):
                state[entry] = value.detach()
            else:
                state[entry] = value
    state[layout.GROUPS_KEY] = [{k: v for k, v in group.items() if k != "params"}
                                for group in optimizer.param_groups]
    state[layout.STEP_COUNT_KEY] = torch.tensor(engine.step_count, dtype=torch.int64)
    if engine.loss_scaler is not None:
        state[layout.LOSS_SCALE_KEY] = torch.tensor(engine.loss_scaler.scale, dtype=torch.float64)
        state[layout.LOSS_SCALE_GOOD_STEPS_KEY] = torch.tensor(engine.loss_scaler.good_steps,
                                                               dtype=torch.int64)
    return state


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
