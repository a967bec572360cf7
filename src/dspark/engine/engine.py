"""``Engine``: data-parallel training of one model on every rank, with the ZeRO stage as policy.

One code path serves every strategy (see :mod:`dspark.engine.policy`):

* gradients are reduced in buckets launched from autograd hooks while backward runs
  (:mod:`dspark.engine.grad_bucket`): all-reduce when every rank keeps whole gradients
  (replicate, zero1), reduce-scatter when each keeps its shard (zero2, zero3);
* the optimizer updates whole parameters (replicate) or this rank's rows of each parameter
  (zero1/2/3); zero1/zero2 then all-gather the updated rows, zero3 keeps only the shard and gathers
  just in time (:mod:`dspark.engine.zero3_units`);
* compute runs under autocast for bf16/fp16 with fp32 master weights and optimizer state; fp16 adds
  dynamic loss scaling (:mod:`dspark.engine.loss_scaler`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dspark import comm
from dspark.engine.batch_check import DEFAULT_BATCH_CHECK_EVERY, BatchCheck
from dspark.engine.grad_bucket import GradBucket, make_buckets
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.memory import expected_state_bytes, optimizer_state_elements, storage_bytes
from dspark.engine.param_slot import ParamSlot
from dspark.engine.policy import precision_policy, sharding_policy
from dspark.engine.zero3_units import Zero3Scheduler
from dspark.tensor import DistTensor, Placement, Replicate, Shard

if TYPE_CHECKING:
    from dspark.checkpoint import CheckpointInfo

__all__ = ["Engine"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class Engine:
    """Wrap ``model`` for data-parallel training on every rank of the world.

    Example::

        engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                               strategy="zero2", precision="bf16")
        for inputs, targets in batches:
            x, y = dspark.distribute_batch((inputs, targets), shard_dim=0)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()

    Every rank builds the same model (names, shapes, dtypes are checked at construction; parameters
    and buffers are then broadcast from rank 0). ``engine.backward(loss)`` is called
    ``grad_accum_steps`` times, then ``engine.step()``: gradients are communicated only on the last
    micro-step, and each backward divides the loss by ``grad_accum_steps``. Under zero2/zero3 the
    whole gradient lives until that last micro-step. On the first step, and every
    ``batch_check_every`` steps after, ranks compare fingerprints of their input batches: identical
    batches raise :class:`dspark.PlacementError` (``None`` turns it off; see engine/batch_check.py).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: OptimizerFactory,
        strategy: str = "replicate",
        precision: str = "fp32",
        grad_accum_steps: int = 1,
        clip_grad_norm: float | None = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        loss_scaler: LossScaler | None = None,
        batch_check_every: int | None = DEFAULT_BATCH_CHECK_EVERY,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise TypeError(
                f"optimizer must be a factory that takes the parameters and returns an optimizer, e.g. "
                f"functools.partial(torch.optim.AdamW, lr=3e-4); got {type(optimizer).__name__} (the "
                f"engine decides which tensors the optimizer updates: whole parameters or shards)")
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={grad_accum_steps!r} must be an int >= 1")
        if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} must be None or a number > 0")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb={bucket_mb!r} must be a number > 0 (megabytes per bucket)")
        if reduce_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"reduce_dtype={reduce_dtype!r} must be None, torch.float32, torch.bfloat16 "
                             "or torch.float16")
        self.strategy = sharding_policy(strategy)
        self.precision = precision_policy(precision)
        self.world = comm.get_world()
        self.grad_accum_steps = grad_accum_steps
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.bucket_mb = float(bucket_mb)
        self.reduce_dtype = reduce_dtype
        self.loss_scaler = (loss_scaler or LossScaler()) if self.precision.loss_scaling else None
        self.last_grad_norm: float | None = None
        self.step_count = 0
        self._micro_step = 0
        self._grads_bytes_held = 0

        self.module = model.to(self.world.device)
        # identical input batches on two ranks raise PlacementError (see engine/batch_check.py)
        self.batch_check = BatchCheck(self.module, every=batch_check_every,
                                      step_count=lambda: self.step_count)
        self._check_same_model_on_every_rank()
        self._broadcast_from_rank0()
        self.slots = self._make_slots()
        n = self.world.world_size
        self._zero3: Zero3Scheduler | None = None
        if self.strategy.shard_params and n > 1:
            opt_params = [s.shard_and_free_full() for s in self.slots]
            self._zero3 = Zero3Scheduler(self.module, self.slots)
        elif self.strategy.shard_optimizer:
            # one rank's shard of a parameter is the whole parameter: zero3 on one rank keeps it
            # in place rather than copying it out and back around every use
            opt_params = [s.view_shard_of_full() for s in self.slots]
        else:
            opt_params = [s.param for s in self.slots]
        opt_params = [p for p in opt_params if p.numel() > 0]
        self.optimizer = optimizer(opt_params)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, "
                            "not a torch.optim.Optimizer")
        self.buckets = make_buckets(self.slots, bucket_mb=self.bucket_mb, num_ranks=n,
                                    shard_grads=self.strategy.shard_grads, reduce_dtype=reduce_dtype)
        self._bucket_of: dict[int, tuple[GradBucket, int]] = {
            id(slot): (bucket, i) for bucket in self.buckets for i, slot in enumerate(bucket.slots)}
        self._next_bucket = 0
        self._sync_grads = True
        self._in_backward = False
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._grad_ready_hook(s))
                       for s in self.slots]

    # -- construction ----------------------------------------------------------------------------
    def _check_same_model_on_every_rank(self) -> None:
        mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in self.module.named_parameters()]
        everyone = comm.all_gather_object(mine)
        reference = everyone[0]
        for rank, theirs in enumerate(everyone):
            if theirs == reference:
                continue
            for i in range(max(len(reference), len(theirs))):
                a = reference[i] if i < len(reference) else None
                b = theirs[i] if i < len(theirs) else None
                if a != b:
                    def fmt(entry: Any) -> str:
                        return "no parameter" if entry is None else f"{entry[0]} {entry[1]} {entry[2]}"
                    raise ValueError(
                        f"rank {self.world.rank}: the model differs between ranks, so data-parallel "
                        f"training cannot start: parameter #{i} is {fmt(a)} on rank 0 but {fmt(b)} on "
                        f"rank {rank} ({len(reference)} vs {len(theirs)} parameters). Build the same "
                        "model on every rank.")

    def _broadcast_from_rank0(self) -> None:
        if self.world.world_size == 1:
            return
        tensors = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
        for group in _chunks_by_bytes(tensors, self.bucket_mb * 2**20):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in group:
                by_dtype.setdefault(t.dtype, []).append(t)
            for same in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in same])
                comm.broadcast(flat, src=0)
                offset = 0
                for t in same:
                    t.copy_(flat[offset: offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _make_slots(self) -> list[ParamSlot]:
        names: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                names.setdefault(id(p), []).append(name)
                params[id(p)] = p
        return [ParamSlot(names[k], params[k], rank=self.world.rank, num_ranks=self.world.world_size)
                for k in params]

    # -- forward / backward ----------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.world.device.type, dtype=self.precision.compute_dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (under autocast for bf16/fp16)."""
        try:
            with self._autocast():
                return self.module(*args, **kwargs)
        except RuntimeError as exc:
            if self._zero3 is None:
                raise
            freed = [s.name for s in self.slots if not s.gathered]
            self._zero3.end_backward()  # a failed forward leaves blocks half-gathered: start clean
            if "shape" not in str(exc) and "size" not in str(exc):
                raise
            raise RuntimeError(
                f"{exc}\n[DSpark zero3] parameters are whole only while the block that owns them runs "
                f"its forward (blocks are the children of nn.ModuleList/nn.Sequential; the root owns "
                f"the rest). A parameter read outside its block, e.g. by the parent's forward, is an "
                f"empty tensor there; freed now: {', '.join(freed[:5])}{' ...' if len(freed) > 5 else ''}. "
                f"Move that use into the block's forward, or use strategy='zero2'.") from exc

    def _grad_ready_hook(self, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._in_backward:
                raise RuntimeError(
                    f"rank {self.world.rank}: gradients of {slot.name} were computed outside "
                    "engine.backward(loss) (a plain loss.backward()?); call engine.backward(loss) so "
                    "that the engine can scale, accumulate and reduce them across ranks")
            if self._zero3 is not None:
                self._zero3.on_grad_accumulated(slot)
            if not self._sync_grads or self.world.world_size == 1:
                return
            bucket, index = self._bucket_of[id(slot)]
            if bucket.mark_ready(index):
                self._launch_ready_buckets()
        return hook

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets):
            bucket = self.buckets[self._next_bucket]
            if len(bucket.ready) < len(bucket.slots):
                return
            bucket.launch(self._pre_scale())
            self._next_bucket += 1

    def _low_precision_wire(self) -> bool:
        return self.reduce_dtype in (torch.bfloat16, torch.float16)

    def _pre_scale(self) -> float:
        return 1.0 / self.world.world_size if self._low_precision_wire() else 1.0

    def _post_scale(self) -> float:
        scale = 1.0 if self._low_precision_wire() else 1.0 / self.world.world_size
        if self.loss_scaler is not None:
            scale /= self.loss_scaler.scale
        return scale

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (divided by ``grad_accum_steps``, times the fp16 loss scale). On the
        last micro-step the gradients are reduced across ranks; before it they accumulate locally."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        if self._micro_step >= self.grad_accum_steps:
            raise RuntimeError(f"rank {self.world.rank}: backward() called {self._micro_step + 1} times "
                               f"with grad_accum_steps={self.grad_accum_steps}; call engine.step() after "
                               f"every {self.grad_accum_steps} backward() calls")
        self.batch_check.before_backward()
        self._micro_step += 1
        self._sync_grads = self._micro_step == self.grad_accum_steps
        scale = 1.0 / self.grad_accum_steps
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        self._in_backward = True
        try:
            (loss * scale if scale != 1.0 else loss).backward()
        finally:
            self._in_backward = False
        if self._zero3 is not None:
            self._zero3.end_backward()
        if self._sync_grads:
            self._finish_grad_sync()

    def _finish_grad_sync(self) -> None:
        if self.world.world_size == 1:
            self._finish_single_rank()
        else:
            for bucket in self.buckets[self._next_bucket:]:
                bucket.launch(self._pre_scale())
            post = self._post_scale()
            for bucket in self.buckets:
                bucket.finish(post)
            self._next_bucket = 0
        for slot in self.slots:
            if slot.opt_param is None:
                continue
            if self.strategy.shard_grads:
                grad = slot.shard_grad
                slot.opt_param.grad = None if grad is None else grad[: slot.local_numel].view(slot.opt_shape)
            else:
                full = slot.param.grad
                slot.opt_param.grad = None if full is None else slot.rows_view(full)[slot.start:slot.stop]
        self._grads_bytes_held = storage_bytes(self._grad_tensors())

    def _finish_single_rank(self) -> None:
        """One rank: nothing to reduce, so no bucket copies; the shard is the whole gradient."""
        post = self._post_scale()
        for slot in self.slots:
            grad = slot.param.grad
            if grad is not None and post != 1.0:
                grad.mul_(post)
            if self.strategy.shard_grads:
                slot.shard_grad = None if grad is None else grad.reshape(-1)
                slot.param.grad = None

    def _grad_tensors(self) -> Iterator[torch.Tensor | None]:
        for slot in self.slots:
            yield slot.shard_grad if self.strategy.shard_grads else slot.param.grad

    def _opt_grads(self) -> list[torch.Tensor]:
        grads = []
        for slot in self.slots:
            p = slot.opt_param if self.strategy.shard_optimizer else slot.param
            if p is not None and p.grad is not None:
                grads.append(p.grad)
        return grads

    # -- optimizer step --------------------------------------------------------------------------
    def step(self) -> bool:
        """Apply the optimizer once the ``grad_accum_steps`` micro-steps are done. Returns False when an
        fp16 overflow (inf/nan in any rank's gradients) skipped the step: parameters and optimizer
        state are then untouched and the loss scale is lowered."""
        if self._micro_step == 0:
            raise RuntimeError(f"rank {self.world.rank}: step() before backward(); call "
                               "engine.backward(loss) first")
        if self._micro_step < self.grad_accum_steps:
            raise RuntimeError(f"rank {self.world.rank}: step() after {self._micro_step} of "
                               f"grad_accum_steps={self.grad_accum_steps} backward() calls")
        self._micro_step = 0
        grads = self._opt_grads()
        if self.loss_scaler is not None:
            overflow = self._found_overflow(grads)
            self.loss_scaler.update(found_overflow=overflow)
            if overflow:
                log.warning("rank %d: fp16 gradients overflowed; step skipped, loss scale now %g",
                            self.world.rank, self.loss_scaler.scale)
                self._zero_grads()
                return False
        if self.clip_grad_norm is not None:
            norm = self._global_grad_norm(grads)
            self.last_grad_norm = norm
            coef = self.clip_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        if self.strategy.shard_optimizer and not self.strategy.shard_params:
            self._gather_updated_rows()
        self._zero_grads()
        self.step_count += 1
        return True

    def _found_overflow(self, grads: list[torch.Tensor]) -> bool:
        # one sync for all gradients: an inf/nan anywhere in a tensor makes its norm inf/nan
        local = bool(grads) and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())
        if not self.strategy.shard_grads:
            return local  # every rank holds the same all-reduced gradients: inf/nan is everywhere
        flag = torch.tensor([1.0 if local else 0.0], device=self.world.device)
        comm.all_reduce(flag, op="max")
        return bool(flag.item() > 0)

    def _global_grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The L2 norm of the whole gradient, as ``torch.nn.utils.clip_grad_norm_`` computes it in one
        process. Shards (zero2/3) sum their squares across ranks; padding rows are zero."""
        if self.strategy.shard_grads:
            local = [s.shard_grad for s in self.slots if s.shard_grad is not None]
        else:
            local = [s.param.grad for s in self.slots if s.param.grad is not None]
        total = torch.zeros(1, dtype=torch.float64, device=self.world.device)
        if local:  # one fused norm per tensor, as clip_grad_norm_ does; no float64 copies of gradients
            total += torch.stack(torch._foreach_norm(local)).double().pow(2).sum()
        if self.strategy.shard_grads:
            comm.all_reduce(total)
        return math.sqrt(float(total.item()))

    def _gather_updated_rows(self) -> None:
        """zero1/zero2: every rank updated its rows; all-gather them into the full parameters."""
        n, me = self.world.world_size, self.world.rank
        inflight = []
        for bucket in self.buckets:
            seg = sum(s.shard_numel for s in bucket.slots)
            send = torch.zeros(seg, dtype=bucket.slots[0].dtype, device=self.world.device)
            offset = 0
            for slot in bucket.slots:
                rows = slot.rows_view(slot.param.detach())[slot.start:slot.stop]
                send[offset: offset + slot.local_numel].copy_(rows.reshape(-1))
                offset += slot.shard_numel
            out = torch.empty((n, seg), dtype=send.dtype, device=send.device)
            inflight.append((bucket, out, comm.all_gather_into_tensor(out, send, async_op=True)))
        for bucket, out, handle in inflight:
            handle.wait()
            offset = 0
            for slot in bucket.slots:
                full = slot.rows_view(slot.param.detach())
                for r in range(n):
                    if r == me:
                        continue
                    start = min(r * slot.chunk, slot.rows)
                    stop = min((r + 1) * slot.chunk, slot.rows)
                    if stop > start:
                        full[start:stop].copy_(out[r, offset: offset + (stop - start) * slot.row_numel]
                                               .view_as(full[start:stop]))
                offset += slot.shard_numel

    def _zero_grads(self) -> None:
        for slot in self.slots:
            slot.param.grad = None
            slot.shard_grad = None
            if slot.opt_param is not None:
                slot.opt_param.grad = None

    # -- state -----------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None unless precision is fp16)."""
        return None if self.loss_scaler is None else self.loss_scaler.scale

    def placements(self) -> dict[str, dict[str, Placement]]:
        """How this engine lays out each trainable parameter, its gradient and its optimizer state
        across ranks: ``{"params" | "grads" | "optimizer_state": {name: Shard(dim=0) | Replicate()}}``.
        Nothing is replicated unless the strategy says so.

        Example::

            dspark.Engine(model, optimizer=opt, strategy="zero2").placements()["grads"]["fc.weight"]
            # Shard(dim=0)
        """
        def layout(sharded: bool) -> dict[str, Placement]:
            return {s.name: (Shard(0) if sharded else Replicate()) for s in self.slots}

        return {"params": layout(self.strategy.shard_params),
                "grads": layout(self.strategy.shard_grads),
                "optimizer_state": layout(self.strategy.shard_optimizer)}

    def sharded_parameters(self) -> dict[str, DistTensor]:
        """This rank's rows of every trainable parameter as a ``Shard(0)`` :class:`DistTensor` (the
        tensors the optimizer updates); raises under ``replicate``, which shards nothing."""
        if not self.strategy.shard_optimizer:
            raise ValueError(f"strategy={self.strategy.name!r} shards nothing; sharded_parameters() "
                             "needs zero1, zero2 or zero3")
        return {s.name: s.dist_shard() for s in self.slots}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, by name as in ``model.state_dict()``, on every
        rank (zero3 gathers them; collective: call it on every rank)."""
        if self._zero3 is not None:
            self._zero3.gather_all()
        try:
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        finally:
            if self._zero3 is not None:
                self._zero3.free_all()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save a sharded checkpoint directory at ``path`` (see :mod:`dspark.checkpoint`): every rank
        writes its shards of the parameters and optimizer state; the step count, hyper-parameters
        and fp16 loss scale come along. A checkpoint already at ``path`` is replaced only once the new
        one is complete. Collective: call it on every rank, between steps.

        Example::

            engine.save("ckpt/latest")
        """
        self._check_between_steps("save")
        # imported here: DCP is heavy to import and most runs never checkpoint
        from dspark.checkpoint import save_checkpoint

        return save_checkpoint(self, path)

    def load(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Load the checkpoint at ``path``, whatever world size and strategy wrote it: parameters,
        buffers, optimizer state (also before the first step), hyper-parameters, step count, fp16
        loss scale. Collective: call it on every rank, between steps. Returns what the checkpoint's
        ``dspark.json`` says (step, strategy, world size, versions).

        Example::

            info = engine.load("ckpt/latest")   # engine.step_count == info.step_count
        """
        self._check_between_steps("load")
        from dspark.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def _check_between_steps(self, what: str) -> None:
        if self._micro_step != 0:
            raise RuntimeError(f"rank {self.world.rank}: {what}() after {self._micro_step} of "
                               f"grad_accum_steps={self.grad_accum_steps} backward() calls; call it "
                               "between steps (after engine.step())")

    def memory_report(self) -> dict[str, int | str]:
        """Bytes this rank holds for parameters, gradients (as held at the end of the last backward)
        and optimizer state, measured from the tensors, next to what the strategy should hold."""
        n = self.world.world_size
        params_actual = storage_bytes(
            s.padded_shard if s.padded_shard is not None else s.param for s in self.slots)
        expected = expected_state_bytes(
            (torch.empty(s.shape, dtype=s.dtype, device="meta") for s in self.slots), self.strategy,
            rank=self.world.rank, num_ranks=n, optimizer_state=optimizer_state_elements(self.optimizer))
        exp_params, exp_grads, exp_opt = expected["params"], expected["grads"], expected["optimizer"]
        opt_actual = storage_bytes(v for state in self.optimizer.state.values()
                                   for v in state.values() if isinstance(v, torch.Tensor))
        report: dict[str, int | str] = {
            "strategy": self.strategy.name,
            "num_ranks": n,
            "num_params": sum(s.numel for s in self.slots),
            "params_bytes": params_actual,
            "params_bytes_expected": exp_params,
            "grads_bytes": self._grads_bytes_held,
            "grads_bytes_expected": exp_grads,
            "optimizer_bytes": opt_actual,
            "optimizer_bytes_expected": exp_opt,
        }
        report["total_bytes"] = params_actual + self._grads_bytes_held + opt_actual
        report["total_bytes_expected"] = exp_params + exp_grads + exp_opt
        return report

    def close(self) -> None:
        """Remove the engine's hooks (the module keeps working as a plain module unless zero3)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.batch_check.remove()
        if self._zero3 is not None:
            self._zero3.remove_hooks()


def _chunks_by_bytes(tensors: Iterable[torch.Tensor], limit: float) -> Iterator[list[torch.Tensor]]:
    group: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append(t)
        size += nbytes
    if group:
        yield group
