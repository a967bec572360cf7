"""zero3: the user's module refuses ``state_dict()`` and ``load_state_dict()`` while its parameters are
freed, instead of saving or comparing empty tensors.

[Note: state dicts under zero3] Between steps a zero3 rank holds only its rows of each parameter;
the module's own parameters are empty tensors (see :mod:`dspark.engine.zero3_units`). A training
loop written for one process or DDP saves ``model.state_dict()``: under zero3 that would write a
file of empty tensors without a word, the failure found only when the weights are loaded for
inference. So every module holding a sharded parameter gets a state-dict pre-hook that raises,
naming the freed parameters and the calls that do the job: ``engine.full_state_dict()`` (the whole
weights, a collective), ``engine.save()`` (a sharded checkpoint with the optimizer), and
``engine.load_full_state_dict()`` for loading. The engine's own state-dict walks (names and buffers
for its checkpoints and full state dicts) run inside :meth:`Zero3StateDictGuard.allowed`.

A module whose parameters are all whole (inside its unit's forward) passes: nothing is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch import nn

from dspark.engine.own_calls import OwnCalls
from dspark.engine.param_slot import ParamSlot
from dspark.errors import Zero3StateDictError

__all__ = ["Zero3StateDictGuard"]

_FIXES = ("For the whole weights call engine.full_state_dict(rank0_only=True, cpu=True) on every rank "
          "(a collective; rank 0 gets the dict, e.g. to torch.save it); for a checkpoint that also holds "
          "the optimizer, the step and your scheduler, engine.save(path, extra={...}) on every rank; to "
          "load a plain state dict (pretrained weights), engine.load_full_state_dict(sd). Or train with "
          "strategy='zero2', which keeps whole parameters on every rank.")


class Zero3StateDictGuard:
    """State-dict hooks on every module of ``root`` holding a parameter of ``slots`` (see the module
    note). ``remove()`` takes them off (``engine.close()``)."""

    def __init__(self, root: nn.Module, slots: Sequence[ParamSlot], *, rank: int) -> None:
        self.rank = rank
        self._own = OwnCalls()
        self._slot_of = {id(s.param): s for s in slots}
        self._handles: list[Any] = []
        seen: set[int] = set()
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            # every module over a sharded parameter: the outermost hook fires first and names all
            if not any(id(p) in self._slot_of for p in module.parameters()):
                continue
            self._handles.append(module.register_state_dict_pre_hook(self._saving))
            register_load = getattr(module, "register_load_state_dict_pre_hook", None)
            if register_load is not None:  # public since PyTorch 2.5; before, torch's size check fails loudly
                self._handles.append(register_load(self._loading))

    def allowed(self) -> contextlib.AbstractContextManager[None]:
        """The engine's own state-dict walks: names and buffers, never the freed values."""
        return self._own.running()

    def _freed(self, module: nn.Module, prefix: str) -> list[str]:
        """The freed parameters under ``module`` (the whole subtree: its own hook fires first), named
        as in its state dict."""
        if self._own:
            return []
        return [prefix + name for name, p in module.named_parameters()
                if id(p) in self._slot_of and not self._slot_of[id(p)].gathered]

    def _saving(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        freed = self._freed(module, prefix)
        if freed:
            raise Zero3StateDictError(
                f"rank {self.rank}: state_dict() of a module trained with strategy='zero3': this rank "
                f"holds only its rows of each parameter and the module's own are freed ({_names(freed)}), "
                f"so the state dict would hold empty tensors. {_FIXES}")

    def _loading(self, module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
        freed = self._freed(module, prefix)
        if freed:
            raise Zero3StateDictError(
                f"rank {self.rank}: load_state_dict() into a module trained with strategy='zero3': its "
                f"parameters are freed between steps ({_names(freed)}) and each rank keeps only its "
                f"rows, so the values cannot be copied in place. {_FIXES}")

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
