"""What ``model.parameters()`` and ``with model.no_sync():`` say when ``model`` is the engine.

[Note: the engine is not the model] A DDP loop wraps its model, ``model = DDP(model)``, and keeps
calling the module's methods on the wrapper: ``torch.nn.utils.clip_grad_norm_(model.parameters(),
c)`` (nanoGPT's clip), ``with model.no_sync():`` around the accumulation's backward,
``model.state_dict()`` in its checkpoint. The port that writes ``model = dspark.Engine(model, ...)``
in its place keeps those lines, and Python's own error, "'Engine' object has no attribute
'parameters'", names neither what the line meant nor what replaces it. So an attribute the engine
lacks is an ``AttributeError`` (``hasattr`` stays False) that says the engine is not the model and
names the engine's way of doing what the line did, or the model's attribute under
``engine.module`` for any other name the model has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["NotTheModule", "missing_attribute"]

_PARAMETERS = ("engine.module.parameters() for the model's parameters; to clip their gradients, "
               "dspark.Engine(..., clip_grad_norm=c) or norm = engine.clip_grad_norm_(c) before "
               "engine.step() (under zero2 and zero3 the module's parameters hold no gradient)")
_INSTEAD = {
    "parameters": _PARAMETERS,
    "named_parameters": _PARAMETERS.replace("parameters()", "named_parameters()", 1),
    "no_sync": ("nothing: the engine reduces the gradients once, in the window's last engine.backward() "
                "(dspark.Engine(..., grad_accum_steps=K)), so drop `with model.no_sync():` and call "
                "engine.backward(loss) for every micro-batch"),
    "require_backward_grad_sync": "nothing: the engine synchronises at the window's last engine.backward()",
    "zero_grad": "nothing: engine.step() clears the window's gradients",
    "state_dict": ("engine.full_state_dict() on every rank for the weights (rank0_only=True, cpu=True to "
                   "hold them on rank 0 only), engine.save(path) for a checkpoint"),
    "load_state_dict": "engine.load_full_state_dict(sd) for the weights, engine.load(path) for a checkpoint",
}


def missing_attribute(module: object, name: str) -> AttributeError:
    """The error for ``engine.<name>`` that the engine does not have (``module``: the engine's model,
    None while the engine is being built).

    Example::

        missing_attribute(model, "parameters")   # AttributeError naming engine.module.parameters()
    """
    plain = AttributeError(f"'Engine' object has no attribute {name!r}")
    if name.startswith("_"):
        return plain
    instead = _INSTEAD.get(name)
    if instead is None and module is not None and hasattr(module, name):
        instead = f"engine.module.{name}, the model's"
    if instead is None:
        return plain
    return AttributeError(
        f"'Engine' object has no attribute {name!r}: a dspark.Engine does not stand in for the model "
        f"as DDP(model) does (a line kept from a DDP loop); use {instead}")


class NotTheModule:
    """The engine's base: an attribute it lacks raises :func:`missing_attribute`'s error (see
    [Note: the engine is not the model]).

    Example::

        engine.parameters()   # AttributeError: ... use engine.module.parameters() ...
    """

    if not TYPE_CHECKING:  # a type checker still reports a misspelled attribute of the engine
        def __getattr__(self, name: str) -> object:
            raise missing_attribute(self.__dict__.get("module"), name)
