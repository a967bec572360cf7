"""zero3 on several ranks: a model's own ``generate()`` (HuggingFace's, or peft's over it) keeps every
rank's forwards in step by default.

[Note: generation under zero3] Every zero3 forward gathers parameters together with every rank (see
[Note: gather tags] in :mod:`dspark.engine.zero3_gather`), so every rank must run the same number of
forwards. HuggingFace's ``generate()`` stops a rank as soon as all its sequences reached their end
token: a rank whose prompts end first stops calling the model while the others go on, and their
next gather has no partner (a ``CollectiveError``, or a hang until the timeout). Its
``synced_gpus=True`` keeps a finished rank running forwards, its output unchanged, until every rank
is done; ``transformers`` turns it on by itself for DeepSpeed ZeRO-3 and FSDP only. So the engine
gives the module (an instance attribute over the class's method, removed by ``engine.close()``) a
``generate`` whose ``synced_gpus`` defaults to True; a value the caller passes wins. Plain
PyTorch's tokens come out on every rank, with no flag from the user. The root unit stays gathered
for the whole call: a peft model's ``generate()`` runs the model it wraps, whose forward is not the
root's, so the root's own gathers would never run.

Example::

    engine = dspark.Engine(model, optimizer=..., strategy="zero3")
    tokens = engine.module.generate(prompt, max_new_tokens=32)   # synced_gpus=True by default
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["SyncedGenerate"]

_ABSENT = object()


def _takes_synced_gpus(module: nn.Module) -> bool:
    """Whether ``module.generate`` (or, for a peft model, its base model's) has ``synced_gpus``."""
    base = getattr(module, "get_base_model", None)
    for candidate in (module, base() if callable(base) else None):
        generate = getattr(candidate, "generate", None)
        if callable(generate):
            try:
                if "synced_gpus" in inspect.signature(generate).parameters:
                    return True
            except (TypeError, ValueError):  # a builtin or C function: no signature to read
                continue
    return False


class SyncedGenerate:
    """Installs the ``generate`` of [Note: generation under zero3] on ``module`` when its own takes
    ``synced_gpus``, run inside ``hold_root()``; :meth:`remove` puts back what was there."""

    def __init__(self, module: nn.Module, hold_root: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        self.module = module
        self.installed = _takes_synced_gpus(module)
        self._previous = module.__dict__.get("generate", _ABSENT)
        if self.installed:
            original: Callable[..., Any] = module.generate  # type: ignore[assignment]

            @functools.wraps(original)
            def generate(*args: Any, **kwargs: Any) -> Any:
                kwargs.setdefault("synced_gpus", True)
                with hold_root():
                    return original(*args, **kwargs)

            object.__setattr__(module, "generate", generate)

    def remove(self) -> None:
        if not self.installed:
            return
        if self._previous is _ABSENT:
            self.module.__dict__.pop("generate", None)
        else:
            object.__setattr__(self.module, "generate", self._previous)
        self.installed = False
