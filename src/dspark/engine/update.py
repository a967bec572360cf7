"""The optimizer update of one window: the global gradient norm, clipping, the skip of a step whose
gradients are not finite, and the optimizer's step, over the gradients this rank holds once the window
is reduced.

The norm is the one ``torch.nn.utils.clip_grad_norm_`` computes in one process: whole gradients
(replicate, zero1) are equal on every rank after the all-reduce and need no collective; shards (zero2,
zero3) sum their squares across ranks (padding rows are zero). On a GPU the step reads the norm on
the host only after the optimizer's kernels are queued (see [Note: the step's one host read] in
:mod:`dspark.engine.host_read`).

[Note: non-finite steps] A NaN or an infinity in one rank's loss or gradients reaches every rank's
gradients through the reduction, and one optimizer step with it makes every parameter NaN for good.
fp16 always skips a step whose gradients are not finite and lowers its loss scale (that is how
dynamic loss scaling works). With ``Engine(skip_nonfinite=True)``, the default, fp32 and bf16 skip it
too (``step()`` returns False on every rank, parameters and optimizer state untouched), on every
strategy, whatever the loss says: an ``inf`` in one rank's input through ``tanh`` gives a finite
loss and infinite gradients. What decides: a loss of the window that was not finite on any rank (a
flag in the reduction's own small vector, [Note: step extras] in :mod:`dspark.engine.grad_reducer`);
then, where the norm is measured anyway (``clip_grad_norm``), a norm that is not finite; else the
reduction's flag, set in the pass that scales the reduced gradients into their mean ([Note: non-finite
gradients found in the reduction] in :mod:`dspark.engine.finite_check`: no extra pass; zero2/zero3
all-reduce it, one element). Every rank reads the same norm or the same flags, so every rank
decides alike. Skips are counted (``engine.nonfinite_steps``), and ``max_nonfinite_skips`` skipped
steps in a row raise ``FloatingPointError``: a loss that stays non-finite is a bug to fix, not a run
to keep going silently (fp16's first steps may overflow while the loss scale falls, 16 halvings from
2**16 to 1, so the default, 20, leaves room for them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch

from dspark import comm
from dspark.engine.host_read import DeferredRead
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.param_slot import ParamSlot
from dspark.policy.optimizer_kernel import skips_on_found_inf

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
                 rank: int, num_ranks: int, defer_host_reads: bool, after_optimizer: Callable[[], None],
                 skip_nonfinite: bool = True, max_nonfinite_skips: int | None = None,
                 group: comm.Group | None = None) -> None:
        self.optimizer = optimizer
        self.slots = list(slots)
        self.shard_grads = shard_grads
        self.loss_scaler = loss_scaler
        self.clip_grad_norm = clip_grad_norm
        self.device = device
        self.rank = rank
        self.num_ranks = num_ranks
        """The ranks that split the gradients' rows between them (zero2/zero3): ``group``'s (None: the
        world's; a hybrid shard group's, whose shards the replica groups hold again)."""
        self.group = group
        self.defer_host_reads = defer_host_reads
        self.after_optimizer = after_optimizer
        self.skip_nonfinite = skip_nonfinite
        self.max_nonfinite_skips = max_nonfinite_skips
        self.last_grad_norm: float | None = None
        """The global gradient norm of the last step that measured it (inf or nan on an overflow)."""
        self.nonfinite_steps = 0
        """Steps skipped because the gradient norm was not finite (fp16 overflows included)."""
        self.nonfinite_in_a_row = 0

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
            comm.all_reduce(total, group=self.group, label="dspark.grad_norm.all_reduce")
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

    def apply(self, *, nonfinite_loss: bool = False, found_inf: torch.Tensor | None = None) -> bool:
        """The optimizer step over the reduced gradients. False when it was skipped: a loss of the
        window not finite on some rank, a reduced gradient not finite (``found_inf``: this rank's
        flag from the reduction, see [Note: non-finite gradients found in the reduction] in
        :mod:`dspark.engine.finite_check`), or, where the norm is measured, a global gradient norm
        not finite (see [Note: non-finite steps])."""
        guard = self.skip_nonfinite or self.loss_scaler is not None
        if guard and nonfinite_loss:  # every rank read the same flag with the reduction
            return not self._skips(True, what="a loss of the window")
        if self.clip_grad_norm is None:  # no norm: the reduction's flag decides
            flag = self._every_ranks_flag(found_inf) if guard else None
            if flag is None:
                self.nonfinite_in_a_row = 0
                self._optimizer_step(None)
                return True
            if self.defer_host_reads and skips_on_found_inf(self.optimizer):
                read = DeferredRead(flag)
                self._optimizer_step(flag)  # the device skips the update; the host reads afterwards
                return not self._skips(read.value() > 0, what="a reduced gradient")
            if self._skips(bool(flag.item() > 0), what="a reduced gradient"):
                return False
            self._optimizer_step(None)
            return True
        if self.defer_host_reads and (not guard or skips_on_found_inf(self.optimizer)):
            return self._apply_reading_the_norm_after(guard)
        norm = self.global_grad_norm()
        self.last_grad_norm = norm  # inf or nan on an overflow, as clip_grad_norm_ after unscale_
        if self._skips(not math.isfinite(norm), what="the global gradient norm"):
            return False
        self.clip_to(self.clip_grad_norm, norm)
        self._optimizer_step(None)
        return True

    def _every_ranks_flag(self, found_inf: torch.Tensor | None) -> torch.Tensor | None:
        """``found_inf`` as every rank's: shards (zero2, zero3) differ, so their flags are or-ed
        across ranks in one all-reduce of one element (whole gradients are equal everywhere)."""
        if found_inf is not None and self.shard_grads and self.num_ranks > 1:
            comm.all_reduce(found_inf, op="max", group=self.group, label="dspark.nonfinite_grads.all_reduce")
        return found_inf

    def _optimizer_step(self, found_inf: torch.Tensor | None) -> None:
        """``optimizer.step()`` then ``after_optimizer()``; with ``found_inf`` (a fused Adam, AdamW or
        SGD: :func:`skips_on_found_inf`), the kernel skips the update on the device when it is 1,
        ``torch.amp.GradScaler``'s protocol. zero1/zero2 gather their rows whatever the device
        decided: after a skip the rows are the ones every rank already holds, and the ranks stay in
        step with each other."""
        if found_inf is None:
            self.optimizer.step()
        else:
            self.optimizer.found_inf = found_inf.float().reshape(())  # type: ignore[attr-defined]
            self.optimizer.grad_scale = None  # type: ignore[attr-defined]  # unscaled already
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf, self.optimizer.grad_scale  # type: ignore[attr-defined]
        self.after_optimizer()

    def _apply_reading_the_norm_after(self, guard: bool) -> bool:
        """The step with its one host read after the optimizer's kernels are queued: the clip
        coefficient stays on the device, a non-finite norm (``guard``) skips the fused kernel's
        update on the device, and the host waits only for the norm."""
        total = self.grad_norm_squared()
        read = DeferredRead(total)
        if self.clip_grad_norm is not None:
            coef = (self.clip_grad_norm / (total.sqrt() + 1e-6)).clamp_(max=1.0).float().reshape(())
            grads = [g for g in self.owned_grads() if g is not None]
            if grads:
                torch._foreach_mul_(grads, coef)
        self._optimizer_step((~torch.isfinite(total)).float() if guard else None)
        norm = math.sqrt(read.value())
        self.last_grad_norm = norm
        return not self._skips(not math.isfinite(norm), what="the global gradient norm") if guard else True

    def _skips(self, bad: bool, *, what: str) -> bool:
        """Whether a step where ``what`` was (``bad``) or was not finite is skipped (see [Note:
        non-finite steps]); fp16's loss scale backs off or grows with it. Counts a skip, and raises
        after ``max_nonfinite_skips`` skips in a row."""
        if self.loss_scaler is not None:  # fp16's overflow check is this same flag
            self.loss_scaler.update(found_overflow=bad)
            if bad:
                log.warning("rank %d: fp16 gradients overflowed (%s is not finite); step skipped, loss "
                            "scale now %g", self.rank, what, self.loss_scaler.scale)
        elif bad and self.skip_nonfinite:
            log.warning("rank %d: %s is not finite: step skipped on every rank", self.rank, what)
        else:
            bad = False
        if not bad:
            self.nonfinite_in_a_row = 0
            return False
        self.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        limit = self.max_nonfinite_skips
        if limit is not None and self.nonfinite_in_a_row >= limit:
            raise FloatingPointError(
                f"rank {self.rank}: {what} was not finite in {self.nonfinite_in_a_row} steps in a row "
                f"(max_nonfinite_skips={limit}); each was skipped, and training is not progressing. "
                "The loss or the gradients are NaN or infinite: look for a log of 0, a division by "
                "zero, an input holding NaN or inf, or a learning rate that diverged (fp16: a loss "
                "too large for its range, try bf16). Pass max_nonfinite_skips=None to keep skipping "
                "without a limit")
        return True
