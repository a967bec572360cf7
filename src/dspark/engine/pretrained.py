"""Pretrained weights in and out, whatever the strategy, without a whole copy of the model on every
rank (what ``engine.load_pretrained``, ``engine.load_full_state_dict(sd, src_rank=0)`` and
``engine.save_pretrained`` run).

[Note: pretrained weights without N copies] Each rank ends up holding only what its strategy keeps
(:mod:`dspark.engine.weights`): under zero3 its rows of each parameter. So

* ``load_pretrained`` has every rank read the safetensors files' headers (once each) and then its own
  rows of each tensor, those bytes only ([Note: safetensors read once] in
  :mod:`dspark.checkpoint.safetensors_file`): nobody reads the whole model;
* ``load_full_state_dict(sd, src_rank=0)`` has one rank hold the state dict; the others pass None.
  The source rank checks names and shapes first (every rank learns the verdict), then sends one
  tensor at a time, and each rank keeps its rows: a rank holds at most its shard plus one tensor;
* ``save_pretrained`` gathers zero3's units one at a time (as ``full_state_dict`` does); rank 0
  hands each tensor to a shard writer planned ahead from shapes and dtypes, which writes a shard
  as soon as it is complete ([Note: HuggingFace layout] in :mod:`dspark.checkpoint.hf_files`): rank 0
  holds at most one unit and one shard, the other ranks one unit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dspark import comm
from dspark.checkpoint.hf_files import (
    INDEX_FILE,
    SafetensorsSource,
    ShardWriter,
    parse_size,
    plan_shards,
    tensor_bytes,
)
from dspark.checkpoint.info import check_outside_checkpoint
from dspark.engine.failure_agreement import agree
from dspark.engine.param_slot import ParamSlot
from dspark.engine.weights import (
    KeyMap,
    Matching,
    SavedTensor,
    WeightEntry,
    match_keys,
    prefix_hint,
)

__all__ = ["ADAPTER_FILES", "HF_FILES", "Names", "load_from_rank", "load_pretrained", "save_gathered",
           "save_pretrained"]

log = logging.getLogger(__name__)

Names = dict[str, Any]
"""``match_keys``' ``aliases=`` and ``optional=``, for a model known by other names too."""


def _settle(matching: Matching, *, strict: bool, what: str, hint: str = "") -> None:
    problems = matching.problems()
    if not problems:
        return
    if strict:
        raise ValueError(f"{what} does not match the model: {problems}; nothing was loaded "
                         f"(strict=False loads what matches and leaves the rest as it is){hint}")
    log.warning("%s: %s; loading the %d tensor(s) that match", what, problems, len(matching.source_key))


def load_pretrained(entries: Sequence[WeightEntry], names: Names | None, path: str | os.PathLike[str], *,
                    key_map: KeyMap | None = None, strict: bool = True) -> tuple[list[str], list[str]]:
    """Every rank reads its rows of each tensor of the safetensors file or HuggingFace model directory
    at ``path`` into ``entries`` (collective). ``names``: the model's other names, a peft model's
    base names (see :func:`dspark.engine.weights.match_keys`). Returns ``(missing, unexpected)``.

    Example::

        missing, unexpected = load_pretrained(entries, None, "gpt2/", key_map={"h.0.ln_1.weight": ...})
    """
    source: SafetensorsSource | None = None
    matching: Matching | None = None
    failure: Exception | None = None
    try:
        source = SafetensorsSource(path)
        matching = match_keys(entries, {k: h.shape for k, h in source.headers.items()}, key_map,
                              **(names or {}))
        _settle(matching, strict=strict, what=f"the weights at {str(path)!r}",
                hint=prefix_hint([n for e in entries for n in e.names], list(source.headers))
                or ". key_map= renames the file's keys to the model's")
    except Exception as exc:  # the same verdict on every rank, before anything is changed
        failure = exc
    agree(failure, what=f"load_pretrained({str(path)!r})")
    if failure is not None:
        raise failure
    assert source is not None and matching is not None
    try:
        for entry in entries:
            key = matching.source_key.get(entry.name)
            if key is None:
                continue
            rows = entry.rows
            if rows is None:
                entry.install(source.read(key))
            elif not entry.shape:  # 0-d: one row, held by one rank
                entry.install(source.read(key).reshape(1)[rows[0]:rows[1]])
            else:
                entry.install(source.read(key, *rows))
    except Exception as exc:
        failure = exc
    finally:
        source.close()
    agree(failure, what=f"reading {str(path)!r}")
    if failure is not None:
        raise failure
    return matching.missing, matching.unexpected


def load_from_rank(entries: Sequence[WeightEntry], names: Names | None,
                   state_dict: Mapping[str, torch.Tensor] | None, *, src_rank: int | None, strict: bool,
                   device: torch.device) -> tuple[list[str], list[str]]:
    """Load ``state_dict``, held by rank ``src_rank`` only, into ``entries`` on every rank: checked
    there, then sent one tensor at a time, each rank keeping what it holds (collective).
    ``src_rank=None``: every rank holds the same state dict and nothing is sent. Returns
    ``(missing, unexpected)``.

    Example::

        sd = torch.load("model.pt", weights_only=True) if rank == 0 else None
        load_from_rank(entries, None, sd, src_rank=0, strict=True, device=torch.device("cpu"))
    """
    world = comm.get_world()
    if src_rank is not None and (isinstance(src_rank, bool) or not isinstance(src_rank, int)
                                 or not 0 <= src_rank < world.world_size):
        raise ValueError(f"src_rank={src_rank!r} must be a rank in [0, {world.world_size}) or None")
    verdict: tuple[Matching | None, str | None] = (None, None)
    if src_rank is None or world.rank == src_rank:
        try:
            verdict = (_check_state_dict(entries, state_dict, strict=strict, names=names), None)
        except (TypeError, ValueError) as exc:
            verdict = (None, f"{type(exc).__name__}: {exc}")
    if src_rank is not None:
        verdict = comm.broadcast_object(verdict, src=src_rank)
    matching, error = verdict
    if error is not None:
        kind, _, message = error.partition(": ")
        where = "" if src_rank is None or world.world_size == 1 else (
            f"rank {world.rank}: the state dict on rank {src_rank}: ")
        raise (TypeError if kind == "TypeError" else ValueError)(f"{where}load_full_state_dict: {message}")
    assert matching is not None
    for entry in entries:
        key = matching.source_key.get(entry.name)
        if key is None:
            continue
        if src_rank is None or world.rank == src_rank:
            assert state_dict is not None
            whole = state_dict[key].detach().to(device=device, dtype=entry.dtype).contiguous()
        else:
            whole = torch.empty(entry.shape, dtype=entry.dtype, device=device)
        if src_rank is not None and world.world_size > 1:
            comm.broadcast(whole, src=src_rank)
        rows = entry.rows
        entry.install(whole if rows is None else whole.reshape(-1, *entry.shape[1:])[rows[0]:rows[1]])
        del whole
    return matching.missing, matching.unexpected


def _check_state_dict(entries: Sequence[WeightEntry], state_dict: Mapping[str, torch.Tensor] | None, *,
                      strict: bool, names: Names | None) -> Matching:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"the state dict must be a mapping of name -> tensor on the source rank, got "
                        f"{type(state_dict).__name__}")
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key!r} is a {type(value).__name__} in the state dict, not a tensor; "
                            "nothing was loaded")
    matching = match_keys(entries, {k: tuple(v.shape) for k, v in state_dict.items()}, **(names or {}))
    hint = prefix_hint([n for e in entries for n in e.names], list(state_dict))
    if state_dict and len(matching.unexpected) == len(state_dict):
        raise ValueError(f"none of the state dict's {len(state_dict)} keys is a name of the model "
                         f"(first: {list(state_dict)[:3]}; the model's: {[e.name for e in entries[:3]]}), "
                         f"so nothing would load{hint}")
    _settle(matching, strict=strict, what="the state dict", hint=hint)
    return matching


def save_pretrained(tensors: Sequence[SavedTensor], directory: str | os.PathLike[str], *,
                    max_shard_size: int | str, units: Sequence[Sequence[ParamSlot]],
                    gather: Callable[[list[ParamSlot]], None] | None = None,
                    free: Callable[[list[ParamSlot]], None] | None = None, config: Any = None) -> Path:
    """Write ``tensors`` as safetensors shards + index into ``directory`` on rank 0, gathering the
    zero3 ``units`` one at a time with ``gather`` and ``free`` (collective; nothing to gather where
    ``units`` is empty); ``config.save_pretrained(directory)`` beside them when
    the model has a HuggingFace config. Returns the directory.

    Example::

        save_pretrained(saved_as_is(entries), "out/", max_shard_size="5GB", units=[])
    """
    world = comm.get_world()
    out = Path(directory)
    max_bytes = parse_size(max_shard_size)
    groups = _groups(tensors, units)
    plan = plan_shards([(t.name, tensor_bytes(t.shape, t.dtype)) for _, group in groups for t in group],
                       max_shard_bytes=max_bytes)
    writer: ShardWriter | None = None
    failure: Exception | None = None
    if world.rank == 0:
        try:
            writer = ShardWriter(_prepare(out, ADAPTER_FILES), plan)
        except Exception as exc:
            failure = exc
    agree(failure, what=f"save_pretrained({str(out)!r})")
    failure = _gathered(groups, writer.add if writer is not None else None, gather=gather, free=free)
    if writer is not None and failure is None:
        try:
            writer.finish()
            if callable(getattr(config, "save_pretrained", None)):
                config.save_pretrained(str(out))
        except Exception as exc:
            failure = exc
    agree(failure, what=f"writing {str(out)!r}")
    return out


def save_gathered(tensors: Sequence[SavedTensor], directory: str | os.PathLike[str],
                  write: Callable[[Path, dict[str, torch.Tensor]], None], *,
                  units: Sequence[Sequence[ParamSlot]], gather: Callable[[list[ParamSlot]], None] | None = None,
                  free: Callable[[list[ParamSlot]], None] | None = None) -> Path:
    """Gather ``tensors`` (a few: a peft adapter) on rank 0 and hand them whole, as one state dict,
    to ``write(directory, state_dict)`` there (collective; any failure raised on every rank).

    Example::

        save_gathered(saved_as_is(lora_entries), "out/lora", lambda d, sd: save_file(sd, d / "w.st"),
                      units=[])
    """
    world = comm.get_world()
    out = Path(directory)
    collected: dict[str, torch.Tensor] = {}
    failure: Exception | None = None
    if world.rank == 0:
        try:
            _prepare(out, HF_FILES)
        except Exception as exc:
            failure = exc
    agree(failure, what=f"save_pretrained({str(out)!r})")
    failure = _gathered(_groups(tensors, units), collected.__setitem__ if world.rank == 0 else None,
                        gather=gather, free=free)
    if world.rank == 0 and failure is None:
        try:
            write(out, collected)
        except Exception as exc:
            failure = exc
    agree(failure, what=f"writing {str(out)!r}")
    return out


def _gathered(groups: list[tuple[list[ParamSlot], list[SavedTensor]]],
              add: Callable[[str, torch.Tensor], None] | None, *,
              gather: Callable[[list[ParamSlot]], None] | None,
              free: Callable[[list[ParamSlot]], None] | None) -> Exception | None:
    """Every group gathered in turn (every rank), each tensor computed and handed to ``add`` (rank 0's
    writer; None elsewhere); the first failure, which the caller raises on every rank."""
    failure: Exception | None = None
    for slots, group in groups:
        if slots and gather is not None:
            gather(slots)
        try:
            if add is not None and failure is None:
                for tensor in group:
                    add(tensor.name, tensor.value().to("cpu", copy=True))
        except Exception as exc:  # keep gathering with the others; raised on every rank by the caller
            failure = exc
        finally:
            if slots and free is not None:
                free(slots)
    return failure


def _groups(tensors: Sequence[SavedTensor], units: Sequence[Sequence[ParamSlot]]
            ) -> list[tuple[list[ParamSlot], list[SavedTensor]]]:
    """``(slots to gather, tensors then computed)``: one group per zero3 unit (a tensor goes with the
    unit of the first entry it needs), then everything else; a group gathers every slot its tensors
    need."""
    unit_of = {id(s): i for i, unit in enumerate(units) for s in unit}
    members: list[list[SavedTensor]] = [[] for _ in range(len(units) + 1)]
    for tensor in tensors:
        first = tensor.needs[0].slot if tensor.needs else None
        members[unit_of.get(id(first), len(units))].append(tensor)
    groups: list[tuple[list[ParamSlot], list[SavedTensor]]] = []
    for index, group in enumerate(members):
        if not group and index < len(units):
            continue
        slots = {id(e.slot): e.slot for t in group for e in t.needs if e.slot is not None and e.rows is not None}
        groups.append((list(slots.values()), group))
    return groups


HF_FILES = ("model*.safetensors", INDEX_FILE, "config.json")
"""What a whole model's save writes (and an adapter's save removes, left by an earlier save)."""
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")
"""What peft writes for an adapter (and a whole model's save removes: ``transformers`` would load a
directory holding ``adapter_config.json`` as an adapter over another base)."""


def _prepare(out: Path, stale: Sequence[str]) -> Path:
    """Rank 0: the directory, with any weights a previous save left there removed (a save with fewer
    shards would leave stale ones that an index no longer names), and the ``stale`` files of the
    other kind of save."""
    check_outside_checkpoint(out, what="save_pretrained")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{str(out)!r} is a file; save_pretrained writes a directory")
    out.mkdir(parents=True, exist_ok=True)
    for pattern in ("model*.safetensors", INDEX_FILE, *stale):
        for path in out.glob(pattern):
            if path.is_file():
                path.unlink()
    return out
