"""What a loss's autograd graph says about the line that made it: a loss divided (or multiplied) by
the accumulation count, whatever its spelling.

[Note: a loss divided by the accumulation count] ``Engine(grad_accum_steps=K)`` averages the
window's K micro-batches inside ``engine.backward`` (see [Note: the averaging rule] in
:mod:`dspark.engine.window`). A loop kept from DDP divides its loss by K as well (``loss = loss /
gradient_accumulation_steps``), and its gradients then come out K times too small: clipping K times
looser, AdamW's epsilon K times heavier, SGD K times slower, no error anywhere. ``dspark check``
finds the spellings it can read; the loss itself says how it was made whatever the spelling
(``loss / k``, ``loss.div_(k)``, ``loss.mul_(1.0 / k)``, ``loss * k ** -1``, a helper function, a
helper's default argument): the root of its graph is autograd's division or multiplication node,
one of whose two inputs is a constant (no gradient flows to it) that autograd saved to compute the
other's gradient. Nodes that only change a tensor's dtype or shape (``.float()``, ``.reshape(())``)
are looked through. A constant equal to ``K`` or ``1 / K`` (relative tolerance 1e-6, so that
``1.0 / 3`` matches 3) is refused before the backward runs. ``K = 1`` is never refused (nothing to
divide), and neither is a constant held on an accelerator: reading it would wait for the device on
every backward (a number written in Python, ``loss / 4``, is saved on the CPU whatever the loss's
device). A loss meant to be scaled by a constant that happens to equal ``K`` (``0.5 * mse`` with
``grad_accum_steps=2``) passes with ``Engine(allow_accum_scaled_loss=True)``. The check reads a
few attributes of the root node per backward: its cost is a figure in docs/figures.md
(``#ddp-habit-checks``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["AccumScaling", "accum_scaling", "accum_scaling_message"]

# autograd nodes that change only a tensor's dtype or shape: the loss's value goes through unchanged
_TRANSPARENT = ("ToCopyBackward", "CloneBackward", "AliasBackward", "ViewBackward", "ReshapeAliasBackward",
                "SqueezeBackward", "UnsqueezeBackward", "ExpandBackward")
_LOOK_THROUGH = 4  # transparent nodes followed above the root before giving up


class AccumScaling(NamedTuple):
    """How a loss was scaled by the accumulation count."""

    op: str
    """``"division"`` or ``"multiplication"``: autograd's node at the root of the loss's graph."""
    constant: float
    """The constant it divided or multiplied by."""
    divided: bool
    """True when the loss came out ``K`` times smaller (``/ K``, ``* (1 / K)``), False when ``K`` times
    larger (``* K``, ``/ (1 / K)``)."""


def _constant(node: Any, loss_side: int) -> float | None:
    """The value autograd saved for the constant operand of ``node`` (the loss being input
    ``loss_side``), when it is one number readable without waiting for a device."""
    saved = getattr(node, "_saved_other" if loss_side == 0 else "_saved_self", None)
    if isinstance(saved, bool):
        return None
    if isinstance(saved, int | float):
        return float(saved)
    if (isinstance(saved, torch.Tensor) and saved.numel() == 1 and saved.device.type == "cpu"
            and not saved.requires_grad and not saved.is_complex()):
        return float(saved.reshape(()).item())
    return None


def accum_scaling(loss: torch.Tensor, accum_steps: int) -> AccumScaling | None:
    """How ``loss`` was divided or multiplied by ``accum_steps`` (see [Note: a loss divided by the
    accumulation count]), or None.

    Example::

        accum_scaling(model(x).mean() / 4, 4)   # AccumScaling(op='division', constant=4.0, divided=True)
        accum_scaling(model(x).mean(), 4)       # None
    """
    if accum_steps <= 1:
        return None
    node = loss.grad_fn
    for _ in range(_LOOK_THROUGH):
        if node is None:
            return None
        name = type(node).__name__
        if not name.startswith(_TRANSPARENT):
            break
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return None
        node = inputs[0]
    if node is None:
        return None
    name = type(node).__name__
    is_div, is_mul = name.startswith("DivBackward"), name.startswith("MulBackward")
    if not (is_div or is_mul):
        return None
    flowing = [n is not None for n, _ in node.next_functions]
    if len(flowing) == 1:          # an op by a Scalar: the loss is input 0
        loss_side = 0
    elif flowing == [True, False]:
        loss_side = 0
    elif flowing == [False, True] and is_mul:  # c * loss; c / loss is no scaling
        loss_side = 1
    else:
        return None
    if type(node.next_functions[loss_side][0]).__name__.startswith("ReciprocalBackward"):
        return None  # k / loss: no scaling of the loss
    constant = _constant(node, loss_side)
    if constant is None or constant == 0.0:
        return None
    k = float(accum_steps)
    if math.isclose(constant, k, rel_tol=1e-6):
        divided = is_div
    elif math.isclose(constant * k, 1.0, rel_tol=1e-6):
        divided = is_mul
    else:
        return None
    return AccumScaling(op="division" if is_div else "multiplication", constant=constant, divided=divided)


def accum_scaling_message(found: AccumScaling, *, accum_steps: int, rank: int) -> str:
    """The error for a loss ``found`` scaled by the accumulation count: what the line did, what it
    does to the gradients, the fix and the opt-out."""
    k = accum_steps
    if found.divided:
        effect = (f"divided by grad_accum_steps={k} (a line such as loss = loss / {k}, loss.div_({k}), "
                  f"loss * (1 / {k}) or a helper that does it, kept from a DDP loop): the engine already "
                  f"averages the window's {k} micro-batches, so the gradients would come out {k} times "
                  "too small (clipping looser, AdamW's eps heavier, SGD slower) with no other sign. "
                  "Drop the division and pass the micro-batch's mean loss: engine.backward(loss)")
    else:
        effect = (f"multiplied by grad_accum_steps={k}: the engine averages the window's {k} "
                  f"micro-batches itself, so the gradients would come out {k} times too large. Pass "
                  "the micro-batch's mean loss: engine.backward(loss)")
    return (f"rank {rank}: the loss passed to engine.backward() was {effect}. Its autograd graph ends "
            f"in a {found.op} by the constant {found.constant:g}. A loss meant to be scaled by a "
            f"constant equal to {k} (or 1/{k}) passes with dspark.Engine(..., "
            "allow_accum_scaled_loss=True)")
