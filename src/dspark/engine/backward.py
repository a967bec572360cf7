"""One micro-batch's backward and the window's reduction: the loss scaled for its share of the window,
autograd run with the engine's gradient hooks feeding the reducer, and at the window's end the
gradients averaged over ranks and handed to the tensors the optimizer updates.

[Note: fp16 share of the batch] One process on the whole batch backpropagates its mean loss times the
loss scale: each sample's gradient carries ``scale / B``. A rank's loss is the mean over its own
``B / N`` samples, so scaled alone it would carry ``N`` times that, and fp16 would overflow ``N`` times
sooner than in one process (and with ``weight=n``, a loss times a token count would overflow at
once). Under fp16 each backward is therefore scaled by this rank's share of the global batch: ``1 / N``
without weights; with weights, ``weight / S``, ``S`` being the sum over ranks of the window's first
weights that are not all zero (one all-reduce of one number per window). The unit is the same on
every rank, so the reduction stays a plain average, and the optimizer sees the gradient divided by it
again.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from dspark import comm
from dspark.comm import World
from dspark.data.padding import current_batch_is_padding
from dspark.engine.grad_reducer import GradReducer, LocalReducer
from dspark.engine.hyperparams import check_same_hyperparameters, fingerprint
from dspark.engine.loss_graph import accum_scaling, accum_scaling_message
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.param_slot import ParamSlot, SlotState
from dspark.engine.sharded_grad import ShardedGradMarks
from dspark.engine.validation import check_weight
from dspark.engine.window import StepTag, Window
from dspark.engine.zero3_units import Zero3Scheduler
from dspark.tensor.storage import storage_bytes

__all__ = ["BackwardPass"]

# autograd's complaint when an op saw a freed (empty) zero3 parameter and its gradient has the full
# shape: "Function PowBackward0 returned an invalid gradient at index 0 - got [0] but expected
# shape compatible with [2]"
_SECOND_BACKWARD = re.compile(r"backward through the graph a second time")
_EMPTY_PARAMETER_GRADIENT = re.compile(r"invalid gradient at index \d+ - got \[0\]")


class BackwardPass:
    """``engine.backward(loss)`` after its arguments are checked, and the window's reduction.

    Example::

        backward = BackwardPass(slots=slots, frozen_params=[], window=Window(), reducer=reducer,
                                zero3=None, loss_scaler=None, grad_accum_steps=1, shard_grads=False,
                                world=dspark.get_world(), step_count=lambda: 0)
        backward.run(loss, None)        # the window's last backward also reduces (sync)
        backward.end_window()           # after the optimizer step
    """

    def __init__(self, *, slots: Sequence[ParamSlot], frozen_params: Sequence[tuple[str, nn.Parameter]],
                 window: Window, reducer: GradReducer | LocalReducer, zero3: Zero3Scheduler | None,
                 loss_scaler: LossScaler | None, grad_accum_steps: int, shard_grads: bool, world: World,
                 step_count: Callable[[], int], allow_accum_scaled_loss: bool = False,
                 optimizer: torch.optim.Optimizer | None = None, strategy: str = "") -> None:
        self.slots = list(slots)
        self.frozen_params = list(frozen_params)
        """Frozen at construction: a gradient on one later means it was unfrozen (not followed)."""
        self.window = window
        self.reducer = reducer
        self.zero3 = zero3
        self.loss_scaler = loss_scaler
        self.grad_accum_steps = grad_accum_steps
        self.shard_grads = shard_grads
        self.world = world
        self.step_count = step_count
        self.allow_accum_scaled_loss = allow_accum_scaled_loss
        self.optimizer = optimizer
        self.strategy = strategy
        self._marks = ShardedGradMarks(self.slots, strategy=strategy, rank=world.rank) if shard_grads else None
        """Its hyper-parameters are compared across ranks at each reduction (see [Note:
        hyper-parameters in step]); None: not compared."""

    def check(self, loss: torch.Tensor, weight: float | int | torch.Tensor | None) -> float | None:
        """Refuse a backward the window cannot take, with nothing changed; returns the checked weight
        (0 for a loader's padding batch, see [Note: padding batches] in :mod:`dspark.data.padding`)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        w = check_weight(weight)
        if w is not None and current_batch_is_padding():
            w = 0.0  # a copy of a sample another rank trains on: whatever its weight was read from
        if not self.allow_accum_scaled_loss:  # see [Note: a loss divided by the accumulation count]
            found = accum_scaling(loss, self.grad_accum_steps)
            if found is not None:
                raise ValueError(accum_scaling_message(found, accum_steps=self.grad_accum_steps,
                                                       rank=self.world.rank))
        window = self.window
        if window.micro_step >= self.grad_accum_steps:
            raise RuntimeError(f"rank {self.world.rank}: backward() called {window.micro_step + 1} times "
                               f"with grad_accum_steps={self.grad_accum_steps}; call engine.step() after "
                               f"at most {self.grad_accum_steps} backward() calls")
        if window.micro_step > 0 and (w is None) != (window.weight_sum is None):
            raise ValueError(f"rank {self.world.rank}: weight= must be given on every backward() of an "
                             "accumulation window or on none")
        return w

    def grad_ready_hook(self, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        """The hook autograd calls once it accumulated a gradient into ``slot``'s parameter."""
        def hook(param: torch.Tensor) -> None:
            if not self.window.in_backward:
                raise RuntimeError(
                    f"rank {self.world.rank}: gradients of {slot.name} were computed outside "
                    "engine.backward(loss) (a plain loss.backward()?); call engine.backward(loss) so "
                    "that the engine can scale, accumulate and reduce them across ranks")
            self.reducer.on_grad(slot)
            if self.zero3 is not None:
                self.zero3.on_grad_accumulated(slot)
        return hook

    def run(self, loss: torch.Tensor, w: float | None) -> None:
        """Backpropagate one micro-batch's ``loss`` (``w``: its checked ``weight=``); the window's last
        one reduces the window (:meth:`sync`)."""
        window = self.window
        window.micro_step += 1
        sync = window.micro_step == self.grad_accum_steps
        if w is None:
            scale = 1.0 / self.grad_accum_steps
        else:
            scale = w
            window.weight_sum = (window.weight_sum or 0.0) + w
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale * self._fp16_unit(w)
        if w != 0.0:  # see [Note: non-finite steps]: read with the reduction, no host sync here
            bad = ~torch.isfinite(loss.detach()).reshape(())
            window.nonfinite_loss = bad if window.nonfinite_loss is None else window.nonfinite_loss | bad
        self.reducer.begin_backward(sync=sync)
        window.in_backward = True
        try:
            if w != 0.0:
                (loss * scale if scale != 1.0 else loss).backward()
            elif self.zero3 is not None:
                self._zero_weight_backward(loss)
        except BaseException as exc:
            self.end_window()
            if _SECOND_BACKWARD.search(str(exc)):
                raise RuntimeError(
                    f"{exc}\n[DSpark] engine.backward() ran through a graph an earlier backward had "
                    "already freed (retain_graph is not an engine option: each engine.backward() is a "
                    "micro-batch of the accumulation window). For several losses of one forward, "
                    "backpropagate their sum once: engine.backward(loss_a + loss_b)") from exc
            if self.zero3 is not None and _EMPTY_PARAMETER_GRADIENT.search(str(exc)):
                raise RuntimeError(
                    f"{exc}\n[DSpark zero3] the loss used a parameter outside the forward of the "
                    "unit that owns it (a regulariser over engine.module.parameters(), a weight read "
                    "after engine(...) returned): under zero3 a parameter is whole only while its "
                    "unit runs, and an empty tensor elsewhere, so such a term is computed from "
                    "nothing (its value reads 0) and its gradient cannot reach the parameter. Compute "
                    "it inside the model's forward, use the optimizer's weight_decay (per group with "
                    "param_groups=), or use strategy='zero2'.") from exc
            raise
        finally:
            window.in_backward = False
            if self.zero3 is not None:
                self.zero3.end_backward()
        if sync:
            self.sync()

    def _fp16_unit(self, weight: float | None) -> float:
        """This rank's share of the global batch: see [Note: fp16 share of the batch]."""
        window = self.window
        if weight is None:
            window.weight_unit = 1.0 / self.world.world_size
        elif window.weight_unit is None:
            total = torch.tensor([weight], dtype=torch.float64, device=self.world.device)
            comm.all_reduce(total, label="dspark.fp16_weight.all_reduce")
            first = float(total.item())
            if first > 0:
                window.weight_unit = 1.0 / first
        return 1.0 if window.weight_unit is None else window.weight_unit

    def _zero_weight_backward(self, loss: torch.Tensor) -> None:
        """zero3 gathers each unit's parameters inside backward, in the order autograd reaches the
        units, so a rank with ``weight=0`` cannot skip backward: its peers would wait in those
        gathers. It runs backward with every parameter's gradient replaced by zeros before it is
        accumulated (its loss may be 0/0, and 0 * NaN is NaN), which contributes exactly nothing."""
        handles = [slot.param.register_hook(torch.zeros_like) for slot in self.slots
                   if slot.param.requires_grad]
        try:
            (loss * 0.0).backward()
        finally:
            for handle in handles:
                handle.remove()

    def sync(self) -> None:
        """The window's gradients, averaged over ranks, where the optimizer reads them."""
        window = self.window
        weights = window.step_weights(accum_steps=self.grad_accum_steps,
                                      loss_scale=None if self.loss_scaler is None else self.loss_scaler.scale)
        unfrozen = [name for name, p in self.frozen_params if p.grad is not None]
        if unfrozen:
            for _, p in self.frozen_params:
                p.grad = None
            self.end_window()
            raise RuntimeError(
                f"rank {self.world.rank}: {', '.join(unfrozen[:4])}{' ...' if len(unfrozen) > 4 else ''} "
                f"got a gradient but was frozen (requires_grad=False) when the engine was built: the "
                "engine reduces and steps only the parameters trainable at construction. To unfreeze "
                "during training, build a new engine after requires_grad_(True), or build it with the "
                "parameters trainable and param_groups giving them lr=0 until they are to train")
        compared = self.optimizer if self.world.world_size > 1 else None
        try:
            window.has_grads = self.reducer.end_backward(
                weights, StepTag.of(window, self.step_count()), window.nonfinite_loss,
                hyperparameters=0 if compared is None else fingerprint(compared))
            if compared is not None:
                check_same_hyperparameters(self.reducer.hyperparameter_fingerprints, compared,
                                           rank=self.world.rank)
        except BaseException:
            self.end_window()
            raise
        window.synced = True
        for slot in self.slots:
            if slot.state is SlotState.WHOLE:  # the optimizer reads param.grad itself
                continue
            if slot.opt_param is None:
                raise AssertionError(f"{slot.name}: state {slot.state.name} without the optimizer's tensor")
            if self.shard_grads:
                grad = slot.shard_grad_rows()
                slot.opt_param.grad = None if grad is None else grad
            else:
                full = slot.param.grad
                slot.opt_param.grad = None if full is None else slot.rows_view(full)[slot.start:slot.stop]
        window.grads_bytes_held = storage_bytes(self._grad_tensors())
        if self._marks is not None:  # see [Note: a clip of the module's parameters]
            self._marks.install()

    def _grad_tensors(self) -> Iterator[torch.Tensor | None]:
        for slot in self.slots:
            yield slot.shard_grad if self.shard_grads else slot.param.grad

    def end_window(self) -> None:
        """After the step, or a failure: drop this window's gradients and state, so the next window
        starts clean."""
        self.window.reset()
        self.reducer.end_window()
        for slot in self.slots:
            slot.param.grad = None
            slot.shard_grad = None
            if slot.opt_param is not None:
                slot.opt_param.grad = None
