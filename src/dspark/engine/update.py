"""The optimizer update of one window: the global gradient norm, clipping, the fp16 overflow skip and
the optimizer's step, over the gradients this rank holds once the window is reduced.

The norm is the one ``torch.nn.utils.clip_grad_norm_`` computes in one process: whole gradients
(replicate, zero1) are equal on every rank after the all-reduce and need no collective; shards (zero2,
zero3) sum their squares across ranks (padding rows are zero). On a GPU the step reads the norm on
the host only after the optimizer's kernels are queued (see [Note: the step's one host read] in
:mod:`dspark.engine.host_read`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch

from dspark import comm
from dspark.engine.host_read import DeferredRead
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.optimizer_kernel import skips_on_found_inf
from dspark.engine.param_slot import ParamSlot

__all__ = ["Update"]

log = logging.getLogger(__name__)


class Update:
    """Applies ``optimizer`` to the reduced gradients of ``slots``; ``after_optimizer`` runs after each
    optimizer step (zero1/zero2 gather their updated rows there), whether or not the device applied it.

    Example::

        update = Update(optimizer, slots, shard_grads=False, loss_scaler=None, clip_grad_norm=1.0,
                        device=torch.device("cpu"), rank=0, num_ranks=1, defer_host_reads=False,
                        after_optimizer=lambda: None)
        applied = update.apply()        # after the window's gradients are reduced
        update.last_grad_norm           # the norm before clipping
    """

    def __init__(self, optimizer: torch.optim.Optimizer, slots: Sequence[ParamSlot], *, shard_grads: bool,
                 loss_scaler: LossScaler | None, clip_grad_norm: float | None, device: torch.device,
                 rank: int, num_ranks: int, defer_host_reads: bool,
                 after_optimizer: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self.slots = list(slots)
        self.shard_grads = shard_grads
        self.loss_scaler = loss_scaler
        self.clip_grad_norm = clip_grad_norm
        self.device = device
        self.rank = rank
        self.num_ranks = num_ranks
        self.defer_host_reads = defer_host_reads
        self.after_optimizer = after_optimizer
        self.last_grad_norm: float | None = None
        """The global gradient norm of the last step that measured it (inf or nan on an overflow)."""

    def owned_grads(self) -> list[torch.Tensor | None]:
        """The gradient tensors this rank holds: shards (zero2/3) or whole gradients (replicate, zero1;
        identical on every rank after the all-reduce)."""
        if self.shard_grads:
            return [s.shard_grad for s in self.slots]
        return [s.param.grad for s in self.slots]

    def grad_norm_squared(self) -> torch.Tensor:
        """The squared L2 norm of the whole gradient, a float64 tensor of one element on the device."""
        local = [g for g in self.owned_grads() if g is not None]
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if local:  # one fused norm per tensor, as clip_grad_norm_ does; no float64 copies of gradients
            total += torch.stack(torch._foreach_norm(local)).double().pow(2).sum()
        if self.shard_grads and self.num_ranks > 1:
            comm.all_reduce(total)
        return total

    def global_grad_norm(self) -> float:
        """The L2 norm of the whole gradient; inf or nan when any rank's gradient holds one. One host
        synchronisation."""
        return math.sqrt(float(self.grad_norm_squared().item()))

    def clip_to(self, max_norm: float, norm: float) -> None:
        """Scale this rank's gradients by ``max_norm / norm`` when that is below 1, with
        ``clip_grad_norm_``'s epsilon."""
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            grads = [g for g in self.owned_grads() if g is not None]
            if grads:
                torch._foreach_mul_(grads, coef)

    def clip(self, max_norm: float) -> float:
        """:meth:`Engine.clip_grad_norm_`: measure the global norm, clip to ``max_norm``, return the norm."""
        norm = self.global_grad_norm()
        self.last_grad_norm = norm
        self.clip_to(float(max_norm), norm)
        return norm

    def apply(self) -> bool:
        """The optimizer step over the reduced gradients. False when an fp16 overflow skipped it (the
        loss scale lowered)."""
        if self.loss_scaler is None and self.clip_grad_norm is None:
            self.optimizer.step()
            self.after_optimizer()
            return True
        if self.defer_host_reads and (self.loss_scaler is None or skips_on_found_inf(self.optimizer)):
            return self._apply_reading_the_norm_after()
        norm = self.global_grad_norm()
        self.last_grad_norm = norm  # inf or nan on an overflow, as clip_grad_norm_ after unscale_
        if self.loss_scaler is not None and self._fp16_overflowed(norm):
            return False
        if self.clip_grad_norm is not None:
            self.clip_to(self.clip_grad_norm, norm)
        self.optimizer.step()
        self.after_optimizer()
        return True

    def _apply_reading_the_norm_after(self) -> bool:
        """The step with its one host read after the optimizer's kernels are queued: the clip
        coefficient stays on the device, an fp16 overflow skips the fused kernel's update on the
        device, and the host waits only for the norm."""
        total = self.grad_norm_squared()
        read = DeferredRead(total)
        if self.clip_grad_norm is not None:
            coef = (self.clip_grad_norm / (total.sqrt() + 1e-6)).clamp_(max=1.0).float().reshape(())
            grads = [g for g in self.owned_grads() if g is not None]
            if grads:
                torch._foreach_mul_(grads, coef)
        if self.loss_scaler is None:
            self.optimizer.step()
        else:  # a fused Adam, AdamW or SGD (skips_on_found_inf): GradScaler's protocol
            self.optimizer.found_inf = (~torch.isfinite(total)).float().reshape(())  # type: ignore[attr-defined]
            self.optimizer.grad_scale = None  # type: ignore[attr-defined]  # unscaled already
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale  # type: ignore[attr-defined]
        # zero1/zero2 gather their rows whatever the device decided: after an overflow the rows are
        # the ones every rank already holds, and the ranks stay in step with each other
        self.after_optimizer()
        norm = math.sqrt(read.value())
        self.last_grad_norm = norm
        return not (self.loss_scaler is not None and self._fp16_overflowed(norm))

    def _fp16_overflowed(self, norm: float) -> bool:
        """Update the loss scale from this step's norm; True (with a warning) on an overflow."""
        if self.loss_scaler is None:
            raise AssertionError("an overflow check without fp16's loss scaler")
        overflow = not math.isfinite(norm)
        self.loss_scaler.update(found_overflow=overflow)
        if overflow:
            log.warning("rank %d: fp16 gradients overflowed; step skipped, loss scale now %g",
                        self.rank, self.loss_scaler.scale)
        return overflow
