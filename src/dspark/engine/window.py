"""The accumulation window: what one optimizer step's ``backward()`` calls have gathered so far, and
the one rule that turns it into the factor the reduced gradients are multiplied by.

[Note: the averaging rule] The update uses the mean over the window's micro-batches and all ranks.
Without weights each backward scaled its loss by ``1 / grad_accum_steps``, so the sum over ranks is
multiplied by ``grad_accum_steps / micro_steps`` (a window cut short, e.g. at an epoch's end, still
averages its own micro-batches) and divided by the world size. With ``weight=n`` each backward scaled
its loss by ``n``, so the sum over ranks and micro-batches is divided by the sum of all weights (no
weight at all on every rank: nothing to average, the step is skipped). A low-precision wire
pre-divides by the world size on the way in (see :class:`~dspark.engine.grad_reducer.GradReducer`),
which the factor then leaves out; fp16 divides by what it multiplied the losses by. One rank is the
same rule with a world size of 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dspark import comm
from dspark.data.padding import current_batch_is_padding
from dspark.errors import CollectiveError

if TYPE_CHECKING:
    from dspark.comm import World
    from dspark.engine.inputs import ForwardInputs

__all__ = ["StepTag", "StepWeights", "Window", "average_factor", "check_between_steps", "check_in_step",
           "check_ranks_in_step"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepWeights:
    """How this rank's accumulated gradients are to be weighted in the average across ranks."""

    micro_steps: int
    """``backward()`` calls in this accumulation window."""
    accum_steps: int
    """``grad_accum_steps``: each unweighted backward scaled its loss by ``1 / accum_steps``."""
    weight_sum: float | None
    """Sum of the ``weight=`` of this window's backward calls (None: no weights given)."""
    batch_size: int | None
    """Samples this rank's forwards received in the window (dim 0 of the first input), if known."""
    loss_scale: float
    """What fp16 multiplied the losses by beyond their weights: the loss scale times the rank's
    share of the batch (see [Note: fp16 share of the batch] in :mod:`dspark.engine.backward`); 1.0 otherwise."""


def average_factor(weights: StepWeights, *, total_weight: float | None, num_ranks: int,
                   pre_divided: bool) -> float | None:
    """The factor that turns the sum of the ranks' accumulated gradients into the window's mean (see
    [Note: the averaging rule]); None when every rank gave ``weight=0`` (nothing to average).
    ``total_weight`` is the sum of every rank's weights (None: unweighted); ``pre_divided``: the
    gradients were already divided by ``num_ranks`` on the way into the collective.

    Example::

        w = StepWeights(micro_steps=2, accum_steps=4, weight_sum=None, batch_size=8, loss_scale=1.0)
        average_factor(w, total_weight=None, num_ranks=2, pre_divided=False)   # 1.0 (0.5 * 4 / 2)
    """
    if total_weight is not None:
        if total_weight <= 0:
            return None
        base = (num_ranks if pre_divided else 1.0) / total_weight
    else:
        base = (1.0 if pre_divided else 1.0 / num_ranks) * weights.accum_steps / weights.micro_steps
    return base / weights.loss_scale


@dataclass(slots=True)
class Window:
    """One accumulation window's state on this rank, from its first ``backward()`` to ``step()``.

    Example::

        window = Window()
        window.micro_step += 1          # a backward of the window ran
        window.reset()                  # after the step (or a failure): the next window starts clean
    """

    index: int = 0
    """Windows this rank ended before this one: applied or skipped by ``step()``, or ended by a failed
    backward (see [Note: ranks in step])."""
    micro_step: int = 0
    """``backward()`` calls so far in this window."""
    forwards: int = 0
    """Training forwards (autograd on) so far in this window."""
    weight_sum: float | None = None
    """Sum of the window's ``weight=`` values (None: no weights given)."""
    weight_unit: float | None = None
    """fp16: this rank's share of the global batch (see [Note: fp16 share of the batch])."""
    batch_size: int | None = None
    """Samples the window's training forwards received (dim 0 of their first input tensor)."""
    in_backward: bool = False
    """A ``backward()`` of the engine is running (its gradient hooks fire only then)."""
    synced: bool = False
    """The window's gradients are reduced across ranks and where the optimizer reads them."""
    has_grads: bool = False
    """... and hold something to apply (not every rank gave ``weight=0``)."""
    grads_bytes_held: int = 0
    """Bytes of gradients this rank held at the end of the last reduction (for the memory report)."""
    nonfinite_loss: Any = None
    """A bool tensor on the device, True once a loss of this window was not finite (no host sync)."""

    def reset(self) -> None:
        """End the window and start the next one (``grads_bytes_held`` stays: it reports the last
        reduction). A window with nothing in it is not counted (a failure's reset, then step's)."""
        if self.micro_step or self.forwards or self.synced:
            self.index += 1
        self.micro_step = 0
        self.forwards = 0
        self.nonfinite_loss = None
        self.weight_sum = None
        self.weight_unit = None
        self.batch_size = None
        self.synced = False

    def count_forward(self, inputs: ForwardInputs, args: Any, kwargs: Any) -> None:
        """A reader of each training forward's inputs (see [Note: forward inputs]): one more forward,
        and its rows added to ``batch_size`` when they are known (none for a loader's padding batch,
        see [Note: padding batches] in :mod:`dspark.data.padding`)."""
        self.forwards += 1
        rows = 0 if current_batch_is_padding() else inputs.rows
        if rows is not None:
            self.batch_size = (self.batch_size or 0) + rows

    def step_weights(self, *, accum_steps: int, loss_scale: float | None) -> StepWeights:
        """The window as the averaging rule reads it; ``loss_scale`` None unless fp16."""
        return StepWeights(micro_steps=self.micro_step, accum_steps=accum_steps,
                           weight_sum=self.weight_sum, batch_size=self.batch_size,
                           loss_scale=1.0 if loss_scale is None else loss_scale * (self.weight_unit or 1.0))


# [Note: ranks in step] Data parallelism pairs each rank's collectives with its peers': the same
# reduction of the same window, the same gather of the same unit. A rank that skipped a batch (caught
# an exception in backward and went on) or skipped ``engine.step()`` would pair its window N+1 with
# its peers' window N, and every sum would be wrong without an error. So the engine's collectives
# say where each rank is, as a StepTag: the step count, the window's index (windows ended so far,
# however they ended), its backward() and training-forward counts. The gradient reduction carries
# every rank's tag in the small vector it all-reduces anyway ([Note: step extras] in
# :mod:`dspark.engine.grad_reducer`), zero3's gathers carry the window's index in their tags ([Note:
# gather tags]), and the calls that read or write the whole state (full and sharded state dicts,
# save, load) all-gather the tags first. Tags that differ are a CollectiveError on every rank, at
# the first collective after the ranks parted, naming where each rank was.


@dataclass(frozen=True, slots=True)
class StepTag:
    """Where a rank is in training (see [Note: ranks in step]).

    Example::

        StepTag(step=3, window=3, micro_step=1, forwards=1).describe()
        # 'step 3, window 3 (1 backward() and 1 training forward in it)'
    """

    step: int | None
    """The step count (None where only the window is compared: it counts every step too)."""
    window: int
    micro_step: int
    forwards: int

    @classmethod
    def of(cls, window: Window, step: int | None) -> StepTag:
        return cls(step=step, window=window.index, micro_step=window.micro_step, forwards=window.forwards)

    def values(self) -> list[int]:
        return [-1 if self.step is None else self.step, self.window, self.micro_step, self.forwards]

    def encode(self) -> int:
        """The window's position as one integer exact in a float64, bit 0 left free: window
        (mod 2**30), training forwards and backward() calls (mod 2**10 each)."""
        return (((self.window % 2**30) << 21) | ((self.forwards % 2**10) << 11)
                | ((self.micro_step % 2**10) << 1))

    @classmethod
    def decode(cls, value: int) -> StepTag:
        return cls(step=None, window=value >> 21, forwards=(value >> 11) & 1023, micro_step=(value >> 1) & 1023)

    def describe(self) -> str:
        step = "" if self.step is None else f"step {self.step}, "
        return (f"{step}window {self.window} ({self.micro_step} backward() and "
                f"{self.forwards} training forward{'s' if self.forwards != 1 else ''} in it)")


def check_in_step(tags: Sequence[StepTag], *, rank: int, what: str) -> None:
    """Raise :class:`dspark.CollectiveError` when ``tags`` (every rank's, by rank) differ: the ranks
    are at different points of training at ``what``. Every rank sees the same tags, so every rank
    raises.

    Example::

        check_in_step([StepTag(2, 2, 1, 1), StepTag(2, 3, 1, 1)], rank=0, what="the gradient reduction")
        # CollectiveError: rank 0: the ranks reached the gradient reduction at different points ...
    """
    if len(set(tags)) <= 1:  # equal steps, windows and counts (steps None alike)
        return
    where = "; ".join(f"rank {r}: {tag.describe()}" for r, tag in enumerate(tags))
    raise CollectiveError(
        f"rank {rank}: the ranks reached {what} at different points of training ({where}), so their "
        "collectives would pair one rank's batch or step with another's. A rank skipped a batch (an "
        "exception caught around engine.backward() and the loop went on) or skipped engine.step() "
        "(a condition true on some ranks only). Every rank must run every batch and every step: "
        "decide to skip on all ranks together (e.g. from a value all-reduced across ranks), or let "
        "the exception end the run")


def check_ranks_in_step(window: Window, step_count: int, *, world: World, call: str) -> None:
    """Collective: raise on every rank unless every rank is at the same point of training (its
    ``window`` and ``step_count``) as it enters ``engine.<call>()`` (see [Note: ranks in step]).

    Example::

        check_ranks_in_step(Window(), 0, world=dspark.get_world(), call="save")
    """
    if world.world_size == 1:
        return
    mine = torch.tensor(StepTag.of(window, step_count).values(), dtype=torch.int64, device=world.device)
    everyone = comm.all_gather(mine, label=f"dspark.{call}.step_check")
    check_in_step([StepTag(*map(int, t.tolist())) for t in everyone], rank=world.rank,
                  what=f"engine.{call}()")


def check_between_steps(window: Window, step_count: int, *, world: World, call: str,
                        grad_accum_steps: int) -> None:
    """Collective: :func:`check_ranks_in_step` first (a refusal on one rank alone would strand the
    others), then refuse ``engine.<call>()`` inside an accumulation window: it belongs between steps.

    Example::

        check_between_steps(window, 3, world=world, call="save", grad_accum_steps=4)
    """
    check_ranks_in_step(window, step_count, world=world, call=call)
    if window.micro_step != 0:
        raise RuntimeError(f"rank {world.rank}: {call}() after {window.micro_step} of "
                           f"grad_accum_steps={grad_accum_steps} backward() calls; call it "
                           "between steps (after engine.step())")
