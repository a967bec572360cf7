"""``load_checkpoint``: fill an engine from a checkpoint written at any world size, by any strategy.

Each rank asks DCP for exactly the tensors it holds under its own strategy: its rows of each
parameter (zero3) or the whole parameter (replicate, zero1/2), every buffer whole (so every rank
gets the same buffers, at any world size), and its rows of each optimizer-state tensor. Everything
is read into fresh tensors and installed only once every read succeeded: a checkpoint found damaged
or crafted half-way leaves the engine as it was. Optimizer state is allocated from the checkpoint's
metadata (which keys exist, their dtype), so it is restored even before the engine's first step,
then installed with the optimizer's own ``load_state_dict`` (which places ``step`` and casts state as
PyTorch's optimizers expect). Non-tensor values come from ``training_state.json``.

Nothing is unpickled but DCP's metadata, through a restricted unpickler ([Note: loading runs no
code] in :mod:`dspark.checkpoint.safe_metadata`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dspark import comm
from dspark.checkpoint import background, layout, storage
from dspark.checkpoint.errors import CheckpointError
from dspark.checkpoint.info import CheckpointInfo, read_checkpoint_info
from dspark.checkpoint.shards import for_dcp
from dspark.checkpoint.training_state import TrainingState, read_training_state

if TYPE_CHECKING:
    from dspark.engine import Engine

__all__ = ["load_checkpoint"]

log = logging.getLogger(__name__)

_MODEL = layout.model_key("")


def load_checkpoint(engine: Engine, path: str | os.PathLike[str]) -> CheckpointInfo:
    """Load the checkpoint at ``path`` into ``engine``: parameters, buffers, optimizer state and
    hyper-parameters, step count and fp16 loss scale. Collective: every rank calls it, between
    steps. Returns the checkpoint's description.

    Raises :class:`CheckpointNotFoundError` when there is no checkpoint at ``path`` and
    :class:`CheckpointError` when it belongs to another model (naming the first parameter that
    differs) or is partial, damaged or crafted (naming the file); on every rank, before anything
    is changed. A save still writing in the background is waited for first.

    Example::

        info = load_checkpoint(engine, "ckpt/latest")   # what engine.load("ckpt/latest") does
        info.step_count == engine.step_count             # True
    """
    background.wait_for_pending_save()
    world = engine.world
    failure: Exception | None = None
    try:
        directory = Path(path) if isinstance(path, (str, os.PathLike)) else None
        if directory is None:
            raise TypeError(f"path={path!r} must be a str or os.PathLike, got {type(path).__name__}")
        info = read_checkpoint_info(directory)
        training = read_training_state(directory)
        metadata = storage.read_metadata(directory)
        storage.check_files(directory, metadata)
        names = _match_names(engine, metadata.state_dict_metadata, directory)
        _check_param_groups(engine, info, training, directory)
    except Exception as exc:
        failure = exc
    # Ranks could see the directory differently (a file system not shared by all): agree first, so
    # that no rank enters DCP's collectives while another has raised.
    reports = comm.all_gather_object(None if failure is None else repr(failure))
    if failure is not None:
        raise failure
    if any(report is not None for report in reports):
        bad = {r: text for r, text in enumerate(reports) if text is not None}
        raise CheckpointError(f"rank {world.rank}: checkpoint {str(path)!r} cannot be loaded on "
                              f"rank(s) {sorted(bad)}: {bad}")

    state, finish = _destination(engine, metadata.state_dict_metadata, names)
    storage.read_state(state, directory, metadata, distributed=world.is_distributed)
    finish(state, training)
    log.info("rank %d: loaded checkpoint %s (step %d, written by %s on %d rank(s))", world.rank,
             directory, info.step_count, info.strategy, info.world_size)
    return info


def _match_names(engine: Engine, entries: dict[str, Any], directory: Path) -> dict[int, str]:
    """Slot id -> the name its tensors have in the checkpoint; raises when the models differ."""
    saved = {key[len(_MODEL):]: tuple(meta.size) for key, meta in entries.items()
             if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)}
    slot_of = {name: slot for slot in engine.slots for name in slot.names}
    chosen: dict[int, str] = {}
    model: list[tuple[str, tuple[int, ...]]] = []
    aliases: list[str] = []
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        slot = slot_of.get(name)
        if slot is None:
            model.append((name, tuple(tensor.shape)))
        elif id(slot) not in chosen:  # a tied parameter: saved once, under one of its names
            pick = next((n for n in slot.names if n in saved), slot.names[0])
            chosen[id(slot)] = pick
            model.append((pick, layout.rows_shape(slot.shape)))
            aliases.extend(n for n in slot.names if n != pick)
    problem = layout.first_mismatch(model, saved, aliases=aliases)
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(directory)!r} is not of this model: {problem} "
                              f"(the model has {len(model)} tensors, the checkpoint {len(saved)})")
    return chosen


def _check_param_groups(engine: Engine, info: CheckpointInfo, training: TrainingState,
                        directory: Path) -> None:
    have = len(engine.optimizer.param_groups)
    saved = len(training.param_groups)
    if info.num_param_groups != saved:
        raise CheckpointError(f"checkpoint {str(directory)!r} is inconsistent: dspark.json says "
                              f"{info.num_param_groups} param group(s), training_state.json holds {saved}")
    if saved != have:
        raise CheckpointError(f"checkpoint {str(directory)!r} has {saved} optimizer "
                              f"param group(s), this engine's optimizer {have}: build the optimizer "
                              "with the same groups")


def _destination(engine: Engine, entries: dict[str, Any], names: dict[int, str]
                 ) -> tuple[dict[str, Any], Callable[[dict[str, Any], TrainingState], None]]:
    """The fresh tensors DCP fills on this rank, and the function that installs what it read."""
    strategy = engine.strategy
    state: dict[str, Any] = {}
    installs: list[tuple[torch.Tensor, str]] = []  # (the engine's tensor, the entry that fills it)

    def read_into(dest: torch.Tensor, key: str, global_rows: tuple[int, ...] | None) -> None:
        scratch = torch.empty_like(dest)
        state[key] = scratch if global_rows is None else for_dcp(scratch, global_rows, sharded=True)
        installs.append((dest, key))

    for slot in engine.slots:
        key = layout.model_key(names[id(slot)])
        if slot.padded_shard is not None:  # zero3 on several ranks: this rank's rows
            read_into(slot.padded_shard[: slot.local_rows], key, layout.rows_shape(slot.shape))
        else:  # every rank holds the whole parameter: read all of it, no gather needed after
            read_into(slot.rows_view(slot.param.detach()), key, None)
    slot_names = {name for slot in engine.slots for name in slot.names}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        if name not in slot_names:  # buffers and frozen parameters: whole, the same on every rank
            read_into(tensor.detach(), layout.model_key(name), None)

    optimizer = engine.optimizer
    index_of = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    # (optimizer index, state key, checkpoint entry, shape to install per-element state in, or None)
    wanted: list[tuple[int, str, str, tuple[int, ...] | None]] = []
    for slot in engine.slots:
        param = slot.opt_param if strategy.shard_optimizer else slot.param
        if param is None or id(param) not in index_of:
            continue  # this rank holds no rows of it (an empty shard): the optimizer skips it
        prefix = layout.optim_prefix(names[id(slot)])
        global_rows = layout.rows_shape(slot.shape)
        for entry, meta in entries.items():
            if not entry.startswith(prefix):
                continue
            per_element = isinstance(meta, TensorStorageMetadata) and tuple(meta.size) == global_rows
            wanted.append((index_of[id(param)], entry[len(prefix):], entry,
                           tuple(param.shape) if per_element else None))
            if per_element:  # split like the parameter
                local_shape = slot.opt_shape if strategy.shard_optimizer else global_rows
                local = torch.empty(local_shape, dtype=meta.properties.dtype, device=param.device)
                state[entry] = for_dcp(local, global_rows, sharded=strategy.shard_optimizer)
            else:  # a scalar such as step: every rank reads it whole (on CPU, as optimizers keep it)
                state[entry] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    plain_values = [(index_of[id(param)], names[id(slot)]) for slot in engine.slots
                    if (param := slot.opt_param if strategy.shard_optimizer else slot.param) is not None
                    and id(param) in index_of]

    def finish(loaded: dict[str, Any], training: TrainingState) -> None:
        with torch.no_grad():
            for dest, key in installs:
                dest.copy_(_local(loaded[key]))
        per_param: dict[int, dict[str, Any]] = {}
        for index, name in plain_values:  # non-tensor optimizer state, from the JSON file
            per_param.setdefault(index, {}).update(training.optimizer_values.get(name, {}))
        for index, state_key, entry, shape in wanted:
            value = loaded[entry]
            if shape is not None:  # the rows view back to the optimizer's tensor (0-d: (1,) -> ())
                value = _local(value).view(shape)
            per_param.setdefault(index, {})[state_key] = value
        _install_optimizer_state(engine, {i: v for i, v in per_param.items() if v},
                                 training.param_groups)
        engine.step_count = training.step_count
        if engine.loss_scaler is not None and training.loss_scale is not None:
            engine.loss_scaler.scale = training.loss_scale
            engine.loss_scaler.good_steps = training.loss_scale_good_steps or 0

    return state, finish


def _local(value: Any) -> torch.Tensor:
    """The tensor behind what DCP filled: a DTensor's local rows, or the plain tensor."""
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


def _install_optimizer_state(engine: Engine, per_param: dict[int, dict[str, Any]],
                             saved_groups: list[dict[str, Any]]) -> None:
    optimizer = engine.optimizer
    current = optimizer.state_dict()["param_groups"]
    groups = [{**saved, "params": now["params"]} for saved, now in zip(saved_groups, current,
                                                                      strict=True)]
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})
