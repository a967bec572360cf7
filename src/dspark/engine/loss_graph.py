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
one of whose two inputs is a number written in Python (no gradient flows to it) that autograd saved
to compute the other's gradient. Nodes that pass a constant factor through unchanged are looked
through: those that only change a tensor's dtype or shape (``.float()``, ``.reshape(())``), and a sum
or a mean (``(loss / k).mean()``, ``(per_sample / k).sum()``: the mean of a divided tensor is the
divided mean). A number equal to ``K`` or ``1 / K`` (relative tolerance 1e-6, so that ``1.0 / 3``
matches 3) is refused before the backward runs. ``K = 1`` is never refused (nothing to divide).
Only a number written in Python counts (``loss / 4``, ``loss / k``, a NumPy scalar: autograd keeps
it as a "wrapped number", which type promotion ranks below every tensor, on the CPU whatever the
loss's device), never a tensor: a divisor held in a tensor is a count taken from the data
(``loss_sum / mask.sum()``, the tokens of this micro-batch), which may equal ``K`` in one batch and
not the next, and a run must not stop on the batch where it does; a tensor on an accelerator could
not be read without waiting for the device either. A loss meant to be scaled by a number that
happens to equal ``K`` (``0.5 * mse`` with ``grad_accum_steps=2``, a sum divided by ``len(batch)``
when the batch holds ``K`` rows) passes with ``Engine(allow_accum_scaled_loss=True)``. The check
reads a few attributes of a few nodes per backward: its cost is a figure in docs/figures.md
(``#ddp-habit-checks``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["AccumScaling", "accum_scaling", "accum_scaling_message"]

# autograd nodes that pass a constant factor of their one input through: a change of dtype or shape,
# a sum or a mean
_TRANSPARENT = ("ToCopyBackward", "CloneBackward", "AliasBackward", "ViewBackward", "ReshapeAliasBackward",
                "SqueezeBackward", "UnsqueezeBackward", "ExpandBackward", "SumBackward", "MeanBackward")
_LOOK_THROUGH = 4  # transparent nodes followed above the root before giving up
# wrapped numbers are float64 or int64; a 0-d tensor of the same dtype would win type promotion over these
_PROMOTION_PROBES = {torch.float64: torch.zeros((), dtype=torch.float16),
                     torch.int64: torch.zeros((), dtype=torch.int8)}


class AccumScaling(NamedTuple):
    """How a loss was scaled by the accumulation count."""

    op: str
    """``"division"`` or ``"multiplication"``: autograd's node at the root of the loss's graph."""
    constant: float
    """The constant it divided or multiplied by."""
    divided: bool
    """True when the loss came out ``K`` times smaller (``/ K``, ``* (1 / K)``), False when ``K`` times
    larger (``* K``, ``/ (1 / K)``)."""


def _written_in_python(saved: torch.Tensor) -> bool:
    """Whether ``saved`` is a number written in Python that autograd wrapped in a tensor (``loss /
    4``), not a tensor of the program's (``loss / mask.sum()``): type promotion ranks a wrapped number
    below every tensor, so it leaves a small dtype as it is where a 0-d tensor of its dtype would not."""
    probe = _PROMOTION_PROBES.get(saved.dtype)
    return (probe is not None and saved.dim() == 0 and saved.device.type == "cpu"
            and torch.result_type(probe, saved) == probe.dtype)


def _constant(node: Any, loss_side: int) -> float | None:
    """The number written in Python that ``node`` scaled the loss (its input ``loss_side``) by, as
    autograd saved it, or None (a tensor, or no number)."""
    saved = getattr(node, "_saved_other" if loss_side == 0 else "_saved_self", None)
    if isinstance(saved, bool):
        return None
    if isinstance(saved, int | float):
        return float(saved)
    if isinstance(saved, torch.Tensor) and not saved.requires_grad and _written_in_python(saved):
        return float(saved.item())
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
            f"number equal to {k} (or 1/{k}), such as a sum divided by a count of samples or tokens "
            f"that is {k} here, passes with dspark.Engine(..., allow_accum_scaled_loss=True)")
