"""How large a batch ``strategy="auto"``'s probe may train inside the budget it is choosing for.

[Note: the probe inside the budget] Given one step's batch, auto probes the model on rank 0 at two
batch sizes, the larger the local batch itself (see [Note: auto with a batch] in
:mod:`dspark.planner.auto_choice`), and it does so in the process the budget is for. When the
whole batch's step does not fit the budget (the reason auto would split the step), a probe at the
whole batch breaks the budget before auto has chosen anything (examples/train_gpt.py at 512 tokens
over a vocabulary of 8192, whose logits dominate: docs/figures.md#probe-rise, the ``gpt-logits``
rows). So before probing, auto predicts what the probe would take at each equal micro-batch of the
local batch, without running it, and lets the probe train only micro-batches that fit:

    probe_rise(m) = PROBE_FIXED_BYTES + PROBE_TENSOR_FACTOR * (state + activations(m))

where ``state`` is the probe's copy of the model trained alone (parameters, gradients, optimizer
state: the one-device row's), and ``activations(m)`` what a step saves for backward at ``m`` rows,
from the fake trace (:func:`dspark.planner.fake_trace.fake_activation_bytes`, on no memory), a line
through 1 row and the largest. The two constants bound what the probe really added to a CPU
process's high water on zoo models at both their sizes and on that GPT at 2 and 8 rows
(``benchmarks/probe_rise.py``, docs/figures.md#probe-rise): the probe trains dozens of steps at
two sizes with no heap guard, so its heap holds more than a training step's, plus its own
measurements (a copy of the gradients, a buffer the C library maps) and the code it runs first.
The bound is loose on activation-heavy models (up to about twice the rise), so under a tight budget
auto may leave a micro-batch it could have trained unprobed, and so unchosen: fail closed.
Where the fake trace cannot run the model, nothing is predicted and the probe runs at the whole
batch; either way auto reads the high water its probes really reached afterwards and refuses where
it passed the budget ([Note: auto's own probes and the budget]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dspark.planner.cost import state_bytes
from dspark.planner.fake_trace import fake_activation_bytes
from dspark.planner.probe import optimizer_state_of
from dspark.planner.table import model_shape

__all__ = ["PROBE_FIXED_BYTES", "PROBE_TENSOR_FACTOR", "ProbeNeed", "probe_need"]

log = logging.getLogger(__name__)

PROBE_FIXED_BYTES = 64 << 20
"""What the probe adds to its process whatever the model (see [Note: the probe inside the budget]):
its page-fault measurement's mapped buffer, the code it runs first."""
PROBE_TENSOR_FACTOR = 3.5
"""The probe's process rise per byte of its copy's model state and a step's activations: the
tensors, the heap's free memory after dozens of steps at two sizes, its copy measurement."""


@dataclass(frozen=True, slots=True)
class ProbeNeed:
    """What auto's probe would add to this process (bytes), predicted before it runs (see [Note: the
    probe inside the budget])."""

    state_bytes: int
    """The probe's copy trained alone: parameters, gradients, optimizer state."""
    one_row_bytes: int
    """What a step saves for backward at one row (the fake trace)."""
    per_row_bytes: float
    """What each further row adds to it."""

    def rise_bytes(self, rows: int) -> int:
        """The probe's predicted rise of the process's high water when its larger batch is ``rows``."""
        activations = self.one_row_bytes + self.per_row_bytes * (rows - 1)
        return int(PROBE_FIXED_BYTES + PROBE_TENSOR_FACTOR * (self.state_bytes + activations))

    def largest_within(self, candidates: list[int], room_bytes: int) -> int | None:
        """The largest of ``candidates`` whose rise fits in ``room_bytes``; None where none does."""
        fitting = [m for m in candidates if self.rise_bytes(m) <= room_bytes]
        return max(fitting) if fitting else None


def probe_need(model: nn.Module, sample_batch: Any, *, loss_fn: Callable[..., torch.Tensor] | None,
               optimizer: Callable[..., torch.optim.Optimizer], precision: str, device: torch.device,
               rows: int) -> ProbeNeed | None:
    """What auto's probe of ``model`` would add to this process at micro-batches of 1 to ``rows``
    rows of ``sample_batch``; None where the fake trace cannot run the model (then nothing is
    predicted: see [Note: the probe inside the budget]).

    Example::

        need = probe_need(model, (x, y), loss_fn=F.cross_entropy, optimizer=torch.optim.AdamW,
                          precision="fp32", device=torch.device("cpu"), rows=8)
        need.largest_within([8, 4, 2, 1], room_bytes=600 << 20)   # 4
    """
    state = sum(state_bytes(model_shape(model, optimizer_state_of(optimizer)), "replicate", 1).values())
    try:
        one = fake_activation_bytes(model, sample_batch, loss_fn=loss_fn, precision=precision, device=device, rows=1)
        whole = (one if rows == 1 else
                 fake_activation_bytes(model, sample_batch, loss_fn=loss_fn, precision=precision, device=device,
                                       rows=rows))
    except Exception as exc:  # an operator fake tensors cannot run: the probe runs as it would
        log.debug("fake trace failed (%r): the probe's size is not predicted", exc)
        return None
    return ProbeNeed(state, one, (whole - one) / (rows - 1) if rows > 1 else 0.0)
