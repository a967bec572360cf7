"""The model's weights as the engine holds them, one entry per tensor of ``model.state_dict()``: what
pretrained weights are loaded into and saved from, whatever the strategy.

An entry is a parameter (tied ones once, with every name) or a persistent buffer. Under zero3 on
several ranks a parameter's entry holds only this rank's rows (:attr:`WeightEntry.rows`); every other
entry is the whole tensor, on every rank. A source of weights gives an entry either its rows or the
whole tensor, and :meth:`WeightEntry.install` copies it in place, so the model's tensors keep their
identity (the optimizer's and zero3's references stay valid).

Example::

    for entry in weight_entries(slots, module_state):
        entry.install(source.read(entry.name, *entry.rows) if entry.rows else source.read(entry.name))
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dspark.engine.param_slot import SHARDED_STATES, ParamSlot

__all__ = ["KeyMap", "Matching", "SavedTensor", "WeightEntry", "match_keys", "prefix_hint", "saved_as_is",
           "weight_entries"]

KeyMap = Mapping[str, str] | Callable[[str], str | None]
"""A source's key -> the model's name (a callable may return None to leave the key out)."""


@dataclass(frozen=True, slots=True)
class WeightEntry:
    """One tensor of the model's state dict, as this rank holds it."""

    names: tuple[str, ...]
    """Its names in ``model.state_dict()`` (a tied parameter has several; the first is saved)."""
    shape: tuple[int, ...]
    """Its whole shape in the model."""
    dtype: torch.dtype
    slot: ParamSlot | None
    """The parameter's slot (None for a buffer, or a frozen parameter the engine does not track)."""
    tensor: torch.Tensor | None
    """The tensor every rank holds whole (None when this rank holds rows only)."""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def rows(self) -> tuple[int, int] | None:
        """``(start, stop)`` of the rows this rank keeps, or None when it keeps the whole tensor."""
        if self.slot is not None and self.slot.state in SHARDED_STATES:
            return self.slot.start, self.slot.stop
        return None

    def install(self, value: torch.Tensor) -> None:
        """Copy ``value`` (this rank's rows, or the whole tensor) into the model, cast to its dtype."""
        with torch.no_grad():
            slot = self.slot
            if slot is not None and slot.state in SHARDED_STATES:
                local = slot.held()[: slot.local_rows]
                local.copy_(value.reshape(local.shape))
                return
            target = slot.param if slot is not None else self.tensor
            if target is None:
                raise AssertionError(f"{self.name}: no tensor to load into")
            target.detach().copy_(value.reshape(self.shape))

    def full(self) -> torch.Tensor:
        """The whole tensor (not under zero3, where it must be gathered first)."""
        target = self.slot.param if self.slot is not None else self.tensor
        if target is None or (self.rows is not None and not self.slot.gathered):  # type: ignore[union-attr]
            raise AssertionError(f"{self.name} is sharded: gather it first")
        return target.detach()


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """One tensor of a saved file: its name there, and how to compute it once the entries it
    ``needs`` are whole (gathered under zero3)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    needs: tuple[WeightEntry, ...]
    """The entries that must be whole while :attr:`value` runs; the first decides which zero3 unit's
    gather writes it."""
    value: Callable[[], torch.Tensor]


def saved_as_is(entries: Sequence[WeightEntry]) -> list[SavedTensor]:
    """Each entry saved under its first name, as it is.

    Example::

        [t.name for t in saved_as_is(entries)]   # the model's state-dict names, a tied weight once
    """
    return [SavedTensor(e.name, e.shape, e.dtype, (e,), e.full) for e in entries]


def weight_entries(slots: Sequence[ParamSlot], module_state: Mapping[str, torch.Tensor]) -> list[WeightEntry]:
    """An entry per tensor of ``module_state`` (``model.state_dict(keep_vars=True)``), in its order;
    ``slots`` are the engine's parameter slots, trainable and frozen.

    Example::

        [e.name for e in weight_entries(engine_slots, model.state_dict(keep_vars=True))]
    """
    slot_of = {name: slot for slot in slots for name in slot.names}
    # a tensor the engine tracks no slot for (a frozen parameter outside zero3) under several names is
    # tied like a slot's: one entry with every name, so a file holding it once fills them all
    names_of: dict[int, list[str]] = {}
    for name, value in module_state.items():
        if name not in slot_of:
            names_of.setdefault(id(value), []).append(name)
    entries: list[WeightEntry] = []
    done: set[int] = set()
    for name, value in module_state.items():
        slot = slot_of.get(name)
        if slot is None:
            if id(value) not in done:
                done.add(id(value))
                entries.append(WeightEntry(tuple(names_of[id(value)]), tuple(value.shape), value.dtype, None, value))
            continue
        if id(slot) in done:
            continue
        done.add(id(slot))
        names = (name, *[n for n in slot.names if n != name and n in module_state])
        whole = None if slot.state in SHARDED_STATES else slot.param
        entries.append(WeightEntry(names, tuple(slot.shape), slot.dtype, slot, whole))
    return entries


class Matching(NamedTuple):
    """How a source's keys meet the model's entries."""

    source_key: dict[str, str]
    """Entry name -> the source key that loads it."""
    missing: list[str]
    """Entries no source key names."""
    unexpected: list[str]
    """Source tensors that name nothing of the model (their names after the key map)."""
    mismatched: list[str]
    """``"'name' has shape (3,) in the source but (4,) in the model"`` for each shape that differs."""

    def problems(self, limit: int = 10) -> str:
        def some(items: list[str]) -> str:
            return f"{items[:limit]}{f' and {len(items) - limit} more' if len(items) > limit else ''}"

        shapes = ", ".join(self.mismatched[:limit]) + (
            f" and {len(self.mismatched) - limit} more" if len(self.mismatched) > limit else "")
        parts = [f"missing {some(self.missing)}" if self.missing else "",
                 f"unexpected {some(self.unexpected)}" if self.unexpected else "",
                 f"mis-shaped: {shapes}" if self.mismatched else ""]
        return "; ".join(p for p in parts if p)


def match_keys(entries: Sequence[WeightEntry], shapes: Mapping[str, tuple[int, ...]],
               key_map: KeyMap | None = None, *, aliases: Mapping[str, Sequence[str]] | None = None,
               optional: Collection[str] = (), alias_problem: str | None = None) -> Matching:
    """Match a source's tensors (key -> shape) to ``entries``; a tied parameter is loaded from the
    first of its names the source holds (HuggingFace stores it once). ``aliases``: a source name that
    is no name of the model -> the model's names it fills (a peft model's base weights, see [Note:
    peft names] in :mod:`dspark.engine.adapters`); ``optional``: names that are not missing when the
    source lacks them (the adapter's own tensors); ``alias_problem``: why ``aliases`` must not be used
    (a ``ValueError`` when a source needs them).

    Example::

        match_keys(entries, {"h.0.attn.c_attn.weight": (768, 2304)},
                   key_map=lambda k: "transformer." + k).missing
    """
    known = {name for e in entries for name in e.names}
    by_model: dict[str, str] = {}
    unexpected: list[str] = []
    for key in shapes:
        mapped = _mapped(key, key_map)
        if mapped is None:
            continue
        if mapped in known:
            _check_one_source(by_model, mapped, key)
            by_model[mapped] = key
        elif aliases is not None and mapped in aliases:
            if alias_problem is not None:
                raise ValueError(alias_problem)
            for name in aliases[mapped]:
                _check_one_source(by_model, name, key)
                by_model[name] = key
        else:
            unexpected.append(mapped)
    source_key: dict[str, str] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    for entry in entries:
        found = next((by_model[n] for n in entry.names if n in by_model), None)
        if found is None:
            if not all(n in optional for n in entry.names):
                missing.append(entry.name)
            continue
        key = found
        if tuple(shapes[key]) != entry.shape:
            mismatched.append(f"{entry.name!r} has shape {tuple(shapes[key])} in the source but {entry.shape} "
                              "in the model")
            continue
        source_key[entry.name] = key
    return Matching(source_key, missing, unexpected, mismatched)


def _check_one_source(by_model: Mapping[str, str], name: str, key: str) -> None:
    """Refuse a second source tensor for the model's ``name``: one of the two would load and the
    other be dropped, reported nowhere (a key_map that maps two keys onto one)."""
    other = by_model.get(name)
    if other is not None and other != key:
        raise ValueError(
            f"two tensors of the source load into the model's {name!r}: {other!r} and {key!r} (after "
            "key_map); one would load and the other be dropped without a word, so nothing was loaded. "
            "Map each to its own name of the model, or skip one (a key_map function returns None for "
            "a key to skip)")


def _mapped(key: str, key_map: KeyMap | None) -> str | None:
    if key_map is None:
        return key
    if callable(key_map):
        return key_map(key)
    return key_map.get(key, key)


def prefix_hint(expected: list[str], given: list[Any]) -> str:
    """A hint when the two key sets differ only by a leading name: a checkpoint saved from a DDP or
    ``torch.compile`` wrapper (``module.``, ``_orig_mod.``) or from a model held inside another;
    ``""`` otherwise.

    Example::

        prefix_hint(["w"], ["module.w"])   # ". Every key of the state dict starts with 'module.' ..."
    """
    names = [k for k in given if isinstance(k, str)]
    if not names or not expected:
        return ""
    want = set(expected)
    for prefix in {k.split(".", 1)[0] + "." for k in names if "." in k}:
        if all(k.startswith(prefix) for k in names) and {k[len(prefix):] for k in names} <= want:
            return (f". Every key of the state dict starts with {prefix!r} (saved from a wrapper, e.g. "
                    f"DDP's 'module.'): strip it, {{k.removeprefix({prefix!r}): v for k, v in sd.items()}}")
    for prefix in {k.split(".", 1)[0] + "." for k in expected if "." in k}:
        if all(k.startswith(prefix) for k in expected) and {prefix + k for k in names} <= want:
            return (f". Every name of the model starts with {prefix!r} (the engine wraps a wrapper, e.g. "
                    f"torch.compile's '_orig_mod.'): add it, {{{prefix!r} + k: v for k, v in sd.items()}}")
    return ""
