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
import dataclasses
import datetime as dt
import logging
import math
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark import comm
from dspark._version import __version__
from dspark.checkpoint import background, extra_state, json_values, layout, manifest, storage
from dspark.checkpoint.atomic import claim, publish, remove_stale, staging_dir
from dspark.checkpoint.info import INFO_FILE, CheckpointInfo, check_outside_checkpoint, write_info
from dspark.checkpoint.target import Checkpointable
from dspark.checkpoint.timeouts import is_timeout, naming_the_checkpoint
from dspark.checkpoint.training_state import STATE_FILE, TrainingState, write_training_state
from dspark.errors import CheckpointSaveError

__all__ = ["save_checkpoint", "split_state"]

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
    config_json: str | None = None
    """Rank 0: the model's HuggingFace config as ``config.json`` holds it, if it has one."""


def save_checkpoint(target: Checkpointable, path: str | os.PathLike[str], *, async_save: bool = False,
                    extra: Mapping[str, Any] | None = None, model_config: Any = None) -> Path:
    """Save ``target``'s (an engine's) model, optimizer and training state as a sharded checkpoint
    directory at ``path``, replacing the checkpoint there only once the new one is complete, with
    every rank's random state and the ``extra`` objects' states (see [Note: extra state] in
    :mod:`dspark.checkpoint.extra_state`). Collective: every rank calls it, between steps. ``path``
    must be on a file system every rank sees.

    ``async_save=True`` returns once the state is copied into CPU memory; the copy is written and
    published in the background (wait with :func:`~dspark.checkpoint.wait_for_pending_save`; the
    next save, a load and ``dspark.shutdown()`` wait by themselves). ``model_config``: the model's
    HuggingFace config, kept as ``config.json`` (see [Note: checkpoint layout]). Returns the
    checkpoint's path.

    Example::

        save_checkpoint(engine, "ckpt/latest")   # what engine.save("ckpt/latest") does
    """
    _check_extra(extra)  # the caller's mistake, the same on every rank: raised before any collective
    background.wait_for_pending_save()  # one save at a time; raises the previous one's failure
    world = target.world
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
    target.sync_buffers()  # one copy of each buffer is saved: make it what every rank holds
    config_json: str | None = None
    try:
        state, training, my_values, info = split_state(target.sharded_state_dict(), rank=world.rank,
                                                       extra=extra)
        state[manifest.save_id_key(world.rank)] = manifest.id_tensor(token)   # in this rank's file
        info = dataclasses.replace(info, save_id=token)
        training = dataclasses.replace(training, save_id=token)
        config_json = model_config.to_json_string() if model_config is not None and world.rank == 0 else None
        if async_save:
            state = storage.stage_on_cpu(state)
    except Exception as exc:  # agreed on below, so that no rank enters DCP's collectives alone
        failure = exc
    _raise_if_any_failed(world.rank, failure, final, staging, comm.default_group())
    job = _Job(state=state, training=_with_everyones_values(training, my_values), info=info,
               final=final, staging=staging, token=token, distributed=world.is_distributed,
               config_json=config_json)
    if not async_save:
        return _write_and_publish(job, comm.default_group())
    group = background.side_group()

    def write_in_background() -> Path:
        with naming_the_checkpoint("save", final, step_count=job.training.step_count, rank=world.rank,
                                   num_ranks=world.world_size):
            return _write_and_publish(job, group)

    background.submit(final, write_in_background)
    log.info("rank %d: checkpoint %s at step %d staged, writing in the background", world.rank,
             final, job.training.step_count)
    return final


def _check_extra(extra: Mapping[str, Any] | None) -> None:
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict of name -> object with state_dict(), got {type(extra).__name__}")
    for name, obj in extra.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"extra key {name!r} must be an identifier (it names the state in the "
                             "checkpoint)")
        if not callable(getattr(obj, "state_dict", None)) and not isinstance(obj, Mapping):
            raise TypeError(f"extra[{name!r}] is a {type(obj).__name__}: pass objects with state_dict() "
                            "and load_state_dict() (an LR scheduler, a dspark.DataLoader) or a dict of "
                            "values")


def _absolute(path: str | os.PathLike[str]) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path).absolute()


def _prepare(final: Path) -> tuple[str, str | None, bool]:
    """Rank 0: refuse to replace what is not a checkpoint, clear stale temporaries, create the
    staging directory. Returns (token, problem or None, whether the problem is the caller's) for
    every rank."""
    token = uuid.uuid4().hex   # the save's id (see [Note: checkpoint integrity])
    try:
        check_outside_checkpoint(final, what="engine.save", may_be_one=True)
    except ValueError as exc:
        return token, str(exc), True
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
    if failure is not None and is_timeout(failure):  # see [Note: a checkpoint's timeout names the checkpoint]
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise failure
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
    shards: dict[str, manifest.FileEntry] = {}
    try:
        storage.write_state(job.state, job.staging, distributed=job.distributed, process_group=group.pg)
        shards = _hash_my_shards(job.staging, rank, group.size)
    except Exception as exc:
        failure = exc
    _raise_if_any_failed(rank, failure, job.final, job.staging, group)
    everyones = comm.all_gather_object(shards, group=group)
    try:
        if rank == 0:
            write_training_state(job.staging, job.training)
            write_info(job.staging, job.info)
            if job.config_json is not None:
                (job.staging / layout.CONFIG_FILE).write_text(job.config_json, encoding="utf-8")
            _write_manifest(job, {name: entry for theirs in everyones for name, entry in theirs.items()})
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


def _hash_my_shards(staging: Path, rank: int, world_size: int) -> dict[str, manifest.FileEntry]:
    """This rank's share of the shard files DCP wrote (every ``world_size``-th, in name order), with
    their records as DCP's metadata gives them: the work of hashing is split over the ranks."""
    metadata = storage.read_metadata(staging)
    records: dict[str, list[tuple[int, int]]] = {}
    id_records: dict[str, tuple[int, int]] = {}
    for index, info in dict(metadata.storage_data or {}).items():
        where = (int(info.offset), int(info.length))
        records.setdefault(info.relative_path, []).append(where)
        if index.fqn.startswith(manifest.save_id_key(0)[:-1]):
            id_records[info.relative_path] = where
    mine = {name: records[name] for name in sorted(records)[rank::world_size]}
    return manifest.hash_files(staging, mine, id_records)


def _write_manifest(job: _Job, shards: dict[str, manifest.FileEntry]) -> None:
    """Rank 0, last before publication: the JSON files and ``.metadata`` hashed beside the shards."""
    names = (storage.METADATA_FILE, INFO_FILE, STATE_FILE,
             *([layout.CONFIG_FILE] if job.config_json is not None else []))
    small = manifest.hash_files(job.staging, {name: [] for name in names}, {})
    summary = dataclasses.asdict(job.info)
    manifest.write_manifest(job.staging, manifest.build_manifest(
        job.staging, save_id=job.token, summary=summary, files={**shards, **small}))


def split_state(state: Mapping[str, Any], *, rank: int, extra: Mapping[str, Any] | None = None
                ) -> tuple[dict[str, torch.Tensor], TrainingState, dict[str, dict[str, Any]], CheckpointInfo]:
    """Split a sharded state dict (see [Note: sharded state dict] in :mod:`dspark.engine.state_dict`)
    into what DCP writes (tensors only) and what goes into JSON: ``(tensors, training state,
    this rank's non-tensor optimizer values, description)``. Tensors every rank holds whole are
    written once, from rank 0; shards (DTensors) by every rank. Each value is checked to be
    JSON-able here, so a bad value fails before any file is written.

    Example::

        tensors, training, values, info = split_state(engine.sharded_state_dict(), rank=0)
    """
    tensors: dict[str, torch.Tensor] = {}

    def keep(key: str, value: torch.Tensor) -> None:
        if _is_dtensor(value) or rank == 0:
            tensors[key] = value

    for name, value in state["model"].items():
        keep(layout.model_key(name), value)
    values: dict[str, dict[str, Any]] = {}
    for name, entries in state["optimizer"]["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                keep(layout.optim_key(name, key), value)
            else:
                json_values.encode(value, f"optimizer state {key!r} of {name!r}")
                values.setdefault(name, {})[key] = copy.deepcopy(value)
    # copies: a background save writes them while a scheduler changes the live ones
    groups = [copy.deepcopy(dict(group)) for group in state["optimizer"]["param_groups"]]
    for i, group in enumerate(groups):
        json_values.encode(group, f"optimizer param_groups[{i}]")
    tensors.update(extra_state.rng_tensors(rank))
    extras: dict[str, Any] = {}
    if rank == 0:
        for name, obj in (extra or {}).items():
            value, refs = extra_state.extract_tensors(extra_state.state_of(name, obj), f"extra/{name}")
            json_values.encode(value, f"extra[{name!r}]")
            extras[name] = copy.deepcopy(value)
            tensors.update({key: t.detach().clone() for key, t in refs.items()})
    meta = state["engine"]
    training = TrainingState(step_count=int(meta["step_count"]), loss_scale=meta.get("loss_scale"),
                             loss_scale_good_steps=meta.get("loss_scale_good_steps"), param_groups=groups,
                             extra=extras, rng={str(rank): extra_state.python_rng_state()})
    params = meta.get("params", {})
    info = CheckpointInfo(
        step_count=int(meta["step_count"]), strategy=str(meta["strategy"]), precision=str(meta["precision"]),
        world_size=int(meta["world_size"]), optimizer=str(meta["optimizer"]), num_param_groups=len(groups),
        num_params=sum(math.prod(shape) for shape in params.values()),
        params={name: list(shape) for name, shape in params.items()},
        scalar_params=[str(name) for name in meta.get("scalar_params", [])],
        aliases={str(name): [str(n) for n in others] for name, others in meta.get("aliases", {}).items()},
        dspark_version=__version__, torch_version=torch.__version__,
        created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    return tensors, training, values, info


def _is_dtensor(value: Any) -> bool:
    return callable(getattr(value, "to_local", None))


def _with_everyones_values(training: TrainingState, mine: dict[str, dict[str, Any]]) -> TrainingState:
    """``training`` with every rank's non-tensor optimizer values (a rank holding no rows of a
    parameter has none of its state) and random state; rank 0 writes the file. Collective."""
    merged: dict[str, dict[str, Any]] = {}
    rng: dict[str, dict[str, Any]] = {}
    for theirs, their_rng in comm.all_gather_object((mine, training.rng)):
        for name, values in theirs.items():
            merged.setdefault(name, values)
        rng.update(their_rng)
    return dataclasses.replace(training, optimizer_values=merged, rng=rng)
