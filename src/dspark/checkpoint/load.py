"""``load_checkpoint``: fill an engine from a checkpoint written at any world size, by any strategy.

Each rank asks DCP for exactly the tensors it holds under its own strategy, as the engine's sharded
state dict lays them out (see [Note: sharded state dict] in :mod:`dspark.engine.state_dict`): its rows
of each parameter (zero3) or the whole parameter, every buffer whole (so every rank gets the same
buffers, at any world size), and its rows of each optimizer-state tensor (``placements()`` says which
are sharded). Everything is read into fresh tensors and handed to ``load_sharded_state_dict`` only
once every read succeeded: a checkpoint found damaged or crafted half-way leaves the engine as it was.
Optimizer state is allocated from the checkpoint's metadata (which keys exist, their dtype), so it is
restored even before the engine's first step. Non-tensor values come from ``training_state.json``.

Nothing is unpickled but DCP's metadata, through a restricted unpickler ([Note: loading runs no
code] in :mod:`dspark.checkpoint.safe_metadata`).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dspark import comm
from dspark.checkpoint import background, extra_state, layout, storage
from dspark.checkpoint.info import CheckpointInfo, read_checkpoint_info
from dspark.checkpoint.target import Checkpointable
from dspark.checkpoint.timeouts import is_timeout
from dspark.checkpoint.training_state import STATE_FILE, TrainingState, read_training_state
from dspark.errors import CheckpointError, first_line
from dspark.tensor import Shard

__all__ = ["load_checkpoint"]

log = logging.getLogger(__name__)

_MODEL = layout.model_key("")


def load_checkpoint(target: Checkpointable, path: str | os.PathLike[str], *,
                    extra: Mapping[str, Any] | None = None, optimizer: bool = True,
                    verify: bool = True) -> CheckpointInfo:
    """Load the checkpoint at ``path`` into ``target`` (an engine): parameters, buffers, optimizer
    state and hyper-parameters, step count, fp16 loss scale, this rank's random state, and the
    ``extra`` objects' states (restored in place with their ``load_state_dict``). Collective: every
    rank calls it, between steps. Returns the checkpoint's description.

    Raises :class:`CheckpointNotFoundError` when there is no checkpoint at ``path`` and
    :class:`CheckpointError` when it belongs to another model (naming the first parameter that
    differs), lacks a requested extra state, or is partial, damaged or crafted (naming the file); on
    every rank, before anything is changed. A save still writing in the background is waited for first.

    ``optimizer=False`` loads the model's parameters and buffers only (and the ``extra`` objects):
    the optimizer (any, of any class), the step count, the loss scale and the random state stay as
    they are; the checkpoint's optimizer is neither read nor checked.

    ``verify=False`` loads a checkpoint that has no ``manifest.json`` (written before manifests, or
    its manifest lost), its files unchecked; without it such a checkpoint is refused
    (:class:`CheckpointIntegrityError`), whatever its ``dspark.json`` says.

    Example::

        info = load_checkpoint(engine, "ckpt/latest", extra={"scheduler": sched})
        load_checkpoint(eval_engine, "ckpt/latest", optimizer=False)   # weights only
        info.step_count == engine.step_count             # True
    """
    background.wait_for_pending_save()
    world = target.world
    for attempt in range(1, _ATTEMPTS + 1):
        before = _identity(path)
        error: Exception | None = None
        info: CheckpointInfo | None = None
        try:
            info = _load_once(target, path, extra=extra, optimizer=optimizer, verify=verify)
        except Exception as exc:  # raised below, once every rank knows whether to load again
            if is_timeout(exc):  # see [Note: a checkpoint's timeout names the checkpoint]
                raise
            error = exc
        # A save to the same path published a new checkpoint while this one was read (an evaluator
        # loading ckpt/latest while training saves there): the files read may come from both, so
        # every rank loads again, from the new one. Every load replaces all the state it loads.
        replaced = comm.all_gather_object(_identity(path) != before)
        if not any(replaced):
            if error is not None:
                raise error
            assert info is not None
            return info
        log.warning("rank %d: checkpoint %s was replaced by a new save while it was loaded "
                    "(attempt %d of %d); loading again", world.rank, path, attempt, _ATTEMPTS)
    raise CheckpointError(f"checkpoint {str(path)!r} was replaced by a new save during each of "
                          f"{_ATTEMPTS} loads: save to a new path each time (ckpt/step-N), or load "
                          "when no save is running")


_ATTEMPTS = 3


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """What tells one published checkpoint at ``path`` from the next: a save publishes a new
    directory there (a rename), with its own inode."""
    try:
        status = os.stat(path)
        info = os.stat(Path(path) / "dspark.json")
    except (OSError, TypeError, ValueError):
        return None
    return status.st_ino, status.st_dev, info.st_ino


def _load_once(target: Checkpointable, path: str | os.PathLike[str], *,
               extra: Mapping[str, Any] | None, optimizer: bool, verify: bool) -> CheckpointInfo:
    world = target.world
    failure: Exception | None = None
    try:
        directory = Path(path) if isinstance(path, (str, os.PathLike)) else None
        if directory is None:
            raise TypeError(f"path={path!r} must be a str or os.PathLike, got {type(path).__name__}")
        info = read_checkpoint_info(directory, verify=verify)
        training = read_training_state(directory)
        metadata = storage.read_metadata(directory)
        storage.check_files(directory, metadata)
        template = target.sharded_state_dict()
        names = _match_names(template, metadata.state_dict_metadata, directory)
        _check_extra(extra, training, directory)
        if optimizer:
            _check_param_groups(template, info, training, directory)
            try:
                extra_state.check_rng_state(world.rank, training.rng.get(str(world.rank), {}),
                                            metadata.state_dict_metadata)
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {str(directory)!r}: {exc}; the checkpoint is damaged "
                                      "or was crafted") from exc
    except Exception as exc:
        failure = exc
    # Ranks could see the directory differently (a file system not shared by all): agree first, so
    # that no rank enters DCP's collectives while another has raised.
    _agree(failure, path, world.rank)

    state = _destination(target, template, metadata.state_dict_metadata, names, training, extra)
    if not optimizer:  # weights only: DCP reads nothing else
        state = {key: value for key, value in state.items() if key.startswith(("model/", "extra/"))}
    storage.read_state(state, directory, metadata, distributed=world.is_distributed)
    # The extra objects first, each undone if one refuses its state (a loader built with another
    # batch size): every rank agrees before the engine itself changes.
    undo, refused = _restore_extra(extra, training, state, directory)
    try:
        _agree(refused, path, world.rank)
    except Exception:
        _undo_extra(undo)
        raise
    try:
        sharded = _as_sharded_state_dict(template, state, names, training)
        target.load_sharded_state_dict(sharded if optimizer else {"model": sharded["model"]})
    except Exception:
        _undo_extra(undo)
        raise
    if optimizer:
        extra_state.set_rng_tensors(world.rank, state)
        extra_state.restore_python_rng(training.rng.get(str(world.rank), {}))
    log.info("rank %d: loaded checkpoint %s (step %d, written by %s on %d rank(s))", world.rank,
             directory, info.step_count, info.strategy, info.world_size)
    return info


def _agree(failure: Exception | None, path: str | os.PathLike[str], rank: int) -> None:
    """Raise on every rank if any rank failed: ``failure`` itself where it happened, elsewhere a
    :class:`CheckpointError` naming the ranks and their errors. Collective."""
    reports = comm.all_gather_object(None if failure is None else repr(failure))
    if failure is not None:
        raise failure
    if any(report is not None for report in reports):
        bad = {r: text for r, text in enumerate(reports) if text is not None}
        raise CheckpointError(f"rank {rank}: checkpoint {str(path)!r} cannot be loaded on "
                              f"rank(s) {sorted(bad)}: {bad}")


def _global_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape)  # a DTensor's shape is its global shape


def _match_names(template: Mapping[str, Any], entries: dict[str, Any], directory: Path) -> dict[str, str]:
    """The model's name of each tensor -> its name in the checkpoint; raises when the models differ."""
    saved = {key[len(_MODEL):]: tuple(meta.size) for key, meta in entries.items()
             if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)}
    aliases_of: dict[str, list[str]] = template["engine"].get("aliases", {})
    chosen: dict[str, str] = {}
    model: list[tuple[str, tuple[int, ...]]] = []
    aliases: list[str] = []
    for name, value in template["model"].items():
        candidates = [name, *aliases_of.get(name, [])]
        pick = next((n for n in candidates if n in saved), name)  # a tied parameter: saved once
        chosen[name] = pick
        model.append((pick, _global_shape(value)))
        aliases.extend(n for n in candidates if n != pick)
    problem = layout.first_mismatch(model, saved, aliases=aliases)
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(directory)!r} is not of this model: {problem} "
                              f"(the model has {len(model)} tensors, the checkpoint {len(saved)})")
    return chosen


def _check_param_groups(template: Mapping[str, Any], info: CheckpointInfo, training: TrainingState,
                        directory: Path) -> None:
    mine = template["engine"].get("optimizer")
    if mine is not None and info.optimizer != mine:
        raise CheckpointError(f"checkpoint {str(directory)!r} holds the state of optimizer "
                              f"{info.optimizer}, this engine's optimizer is {mine}: its state and hyper-parameters "
                              f"would not fit. Build the engine with the checkpoint's optimizer "
                              f"({info.optimizer})")
    have = len(template["optimizer"]["param_groups"])
    saved = len(training.param_groups)
    if info.num_param_groups != saved:
        raise CheckpointError(f"checkpoint {str(directory)!r} is inconsistent: dspark.json says "
                              f"{info.num_param_groups} param group(s), training_state.json holds {saved}")
    if saved != have:
        raise CheckpointError(f"checkpoint {str(directory)!r} has {saved} optimizer "
                              f"param group(s), this engine's optimizer {have}: build the optimizer "
                              "with the same groups (the same param_groups function)")
    where = f"checkpoint {str(directory)!r}: {STATE_FILE}"
    for index, (group, current) in enumerate(zip(training.param_groups, template["optimizer"]["param_groups"],
                                                 strict=True)):
        for key, value in group.items():
            if _is_number(current.get(key)) and not _is_number(value):
                raise CheckpointError(f"{where} gives param group {index} {key}={value!r}, where this "
                                      f"optimizer has a number ({current[key]!r}); the checkpoint is "
                                      "damaged or was crafted")
    for name, values in training.optimizer_values.items():
        for key, value in values.items():
            if not (value is None or isinstance(value, (bool, int, float, torch.Tensor))):
                raise CheckpointError(f"{where} gives {name!r}'s optimizer state {key}={value!r}: "
                                      "DSpark saves numbers there; the checkpoint is damaged or was crafted")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_extra(extra: Mapping[str, Any] | None, training: TrainingState, directory: Path) -> None:
    missing = [name for name in (extra or {}) if name not in training.extra]
    if missing:
        raise CheckpointError(f"checkpoint {str(directory)!r} holds no extra state named {missing!r}; "
                              f"it holds {sorted(training.extra)!r} (pass the same extra= names to "
                              "engine.save and engine.load)")
    for name, obj in (extra or {}).items():
        if not callable(getattr(obj, "load_state_dict", None)) and not isinstance(obj, dict):
            raise TypeError(f"extra[{name!r}] is a {type(obj).__name__}: it needs load_state_dict(), "
                            "or must be a dict (updated in place)")


def _destination(target: Checkpointable, template: Mapping[str, Any], entries: dict[str, Any],
                 names: dict[str, str], training: TrainingState,
                 extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fresh tensors DCP fills on this rank, by checkpoint key."""
    world = target.world
    state: dict[str, Any] = {}
    for name, value in template["model"].items():
        state[layout.model_key(names[name])] = storage.empty_like(value)
    placements = target.placements()["optimizer_state"]
    for name, global_rows in template["engine"].get("params", {}).items():
        global_rows = tuple(global_rows)
        sharded = isinstance(placements.get(name), Shard)
        if sharded and target.empty_shard(global_rows, torch.uint8) is None:
            continue  # this rank holds no rows of it: its optimizer skips it
        prefix = layout.optim_prefix(names[name])
        for entry, meta in entries.items():
            if not entry.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
                continue
            dtype = meta.properties.dtype
            if tuple(meta.size) == global_rows:  # per element: split like the parameter
                state[entry] = (target.empty_shard(global_rows, dtype) if sharded else
                                torch.empty(global_rows, dtype=dtype))
            else:  # a scalar such as step: every rank reads it whole (on CPU, as optimizers keep it)
                state[entry] = torch.empty(tuple(meta.size), dtype=dtype)
    for key, meta in entries.items():
        if key.startswith(f"rng/rank{world.rank}/") and isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    for name in extra or {}:
        for key, meta in entries.items():
            if key.startswith(f"extra/{name}/") and isinstance(meta, TensorStorageMetadata):
                state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return state


def _as_sharded_state_dict(template: Mapping[str, Any], loaded: Mapping[str, Any], names: dict[str, str],
                           training: TrainingState) -> dict[str, Any]:
    """What DCP read, in the structure ``load_sharded_state_dict`` takes."""
    model = {name: loaded[layout.model_key(names[name])] for name in template["model"]}
    optim: dict[str, dict[str, Any]] = {}
    for name in template["engine"].get("params", {}):
        prefix = layout.optim_prefix(names[name])
        values = {key[len(prefix):]: value for key, value in loaded.items() if key.startswith(prefix)}
        values.update(training.optimizer_values.get(names[name], {}))
        if values:
            optim[name] = values
    return {"model": model,
            "optimizer": {"state": optim, "param_groups": training.param_groups},
            "engine": {"step_count": training.step_count, "loss_scale": training.loss_scale,
                       "loss_scale_good_steps": training.loss_scale_good_steps}}


_Undo = list[tuple[Any, Any]]
"""(object, the state it held before the load), in the order the objects were restored."""


def _restore_extra(extra: Mapping[str, Any] | None, training: TrainingState, loaded: Mapping[str, Any],
                   directory: Path) -> tuple[_Undo, CheckpointError | None]:
    """Give each extra object its saved state; on the first refusal, undo those already given and
    return the error (naming the object and the file) instead of raising, so that every rank can
    agree first. Returns what undoes the restores."""
    tensors = {key: value for key, value in loaded.items() if key.startswith("extra/")}
    undo: _Undo = []
    for name, obj in (extra or {}).items():
        try:
            value = extra_state.restore_tensors(training.extra[name], tensors)
            before = (copy.deepcopy(obj.state_dict()) if callable(getattr(obj, "load_state_dict", None))
                      else dict(obj))
            undo.append((obj, before))
            _give(obj, value)
        except Exception as exc:
            _undo_extra(undo)
            return [], CheckpointError(
                f"checkpoint {str(directory)!r}: extra[{name!r}] refused its saved state from "
                f"{STATE_FILE} ({type(exc).__name__}: {first_line(exc)}); nothing was loaded. Build it "
                "as in the run that saved (a dspark.DataLoader with the same global_batch_size, seed "
                "and dataset)")
    return undo, None


def _give(obj: Any, value: Any) -> None:
    if callable(getattr(obj, "load_state_dict", None)):
        obj.load_state_dict(value)
    else:
        obj.clear()
        obj.update(value)


def _undo_extra(undo: _Undo) -> None:
    for obj, before in reversed(undo):
        try:
            _give(obj, before)
        except Exception:  # pragma: no cover - an object that refuses its own state
            log.warning("could not restore the state of %r after a failed load", obj)
