"""Whether a model built under a plain ``with torch.device("meta"):`` initialises its parameters only
in ``reset_parameters()``: the one case in which DSpark's module walk (:mod:`dspark.meta.materialize`)
gives the values the CPU build gives.

A constructor that initialises parameters itself (``self.apply(self._init_weights)``, a loop over
``named_parameters()`` with ``torch.nn.init``, ``p.data.normal_()``, HuggingFace's ``post_init()``) ran
on meta tensors and left nothing behind; materialising the model with ``reset_parameters()`` would
silently train from PyTorch's default initialisation instead. The constructors of the model's own
module classes (PyTorch's are known) are read, with the methods they call on ``self``; any sign of
such initialisation, or a constructor whose source cannot be read, is refused with the fix:
``dspark.meta_init()``, which records what the code does instead of guessing.

Example::

    with torch.device("meta"):
        model = NanoGPT(config)          # __init__: self.apply(self._init_weights)
    check_reset_only(model)              # ValueError: ... NanoGPT.__init__ line 147 ... dspark.meta_init()
"""

from __future__ import annotations

import inspect
import re
import textwrap

from torch import nn

__all__ = ["check_reset_only"]

_INIT_WORK = re.compile(
    r"\.apply\(|\bpost_init\(|\binit_weights\(|_init_weights\b|\bnn\.init\.|\binit\.\w+_\(|"
    r"\.(?:normal_|uniform_|zero_|zeros_|ones_|fill_|copy_|mul_|div_|add_|clamp_|trunc_normal_)\(|"
    r"\.data\s*=[^=]|named_parameters\(|\.parameters\(\)")
_SELF_CALL = re.compile(r"\bself\.(\w+)\(")


def check_reset_only(root: nn.Module) -> None:
    """Raise ``ValueError`` naming the class, the line and the fix when a module class of ``root``
    (not PyTorch's own) initialises parameters outside ``reset_parameters()``, or its constructor's
    source cannot be read to tell."""
    seen: set[type] = set()
    for name, module in root.named_modules():
        for cls in type(module).__mro__:
            if cls in seen or cls is nn.Module or cls is object or cls.__module__.startswith("torch."):
                continue
            seen.add(cls)
            found = _init_work(cls)
            if found is not None:
                where = f"module {name!r}" if name else "the model"
                raise ValueError(
                    f"{where} ({type(module).__name__}) was built on the meta device, and "
                    f"{cls.__qualname__}.{found} initialises parameters outside reset_parameters(): "
                    "materialising it with reset_parameters() would train from PyTorch's default "
                    "initialisation instead. Build it under `with dspark.meta_init():` (which records "
                    "and replays the model's own initialisation exactly), or on a real device")


def _init_work(cls: type) -> str | None:
    """Where ``cls``'s constructor (or a method it calls on ``self``) initialises parameters, as
    ``"__init__ line N: text"``; None when it does not."""
    if "__init__" not in cls.__dict__:
        return None
    todo, done = ["__init__"], set()
    while todo:
        method = todo.pop()
        done.add(method)
        func = cls.__dict__.get(method)
        if func is None or not callable(func):
            continue
        try:
            lines, first = inspect.getsourcelines(func)
        except (OSError, TypeError):
            return f"{method} (its source cannot be read, so DSpark cannot tell how it initialises)"
        for offset, line in enumerate(textwrap.dedent("".join(lines)).splitlines()):
            code = line.split("#", 1)[0]
            if _INIT_WORK.search(code):
                return f"{method} line {first + offset}: {code.strip()!r}"
            todo.extend(m for m in _SELF_CALL.findall(code)
                        if m not in done and m not in ("reset_parameters", "_reset_parameters"))
    return None
