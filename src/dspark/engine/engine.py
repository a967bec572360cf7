"""``Engine``: data-parallel training of one model on every rank, with the ZeRO stage as policy.

One code path serves every strategy (see :mod:`dspark.engine.policy`):

* gradients are reduced in single-dtype buckets launched from autograd hooks while backward runs
  (:mod:`dspark.engine.grad_reducer`, :mod:`dspark.engine.grad_bucket`): whole gradients living in the
  buckets (replicate, zero1), or shards kept from a pooled send buffer (zero2, zero3);
* the optimizer updates whole parameters (replicate) or this rank's rows of each parameter
  (zero1/2/3); zero1/zero2 then all-gather the updated rows, zero3 keeps only the shard and gathers
  just in time (:mod:`dspark.engine.zero3_units`);
* compute runs under autocast for bf16/fp16 with fp32 master weights and optimizer state; fp16 adds
  dynamic loss scaling (:mod:`dspark.engine.loss_scaler`);
* BatchNorm buffers follow rank 0 before each training forward as in DDP
  (:mod:`dspark.engine.buffer_sync`), or use global batch statistics (``sync_batchnorm=True``,
  :mod:`dspark.engine.global_batchnorm`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from dspark import comm, cpu_malloc
from dspark.engine.agreement import agree
from dspark.engine.audit import BatchRecord, audit_rows, record_batch
from dspark.engine.batch_check import DEFAULT_BATCH_CHECK_EVERY, BatchCheck
from dspark.engine.buffer_sync import BufferSync, broadcast_tensors
from dspark.engine.compile_boundary import outside_compile
from dspark.engine.global_batchnorm import convert_batchnorm, restore_batchnorm
from dspark.engine.grad_bucket import BufferPool, GradBucket
from dspark.engine.grad_reducer import GradReducer, StepWeights
from dspark.engine.host_read import DeferredRead
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.materialize import has_meta_tensors, materialize
from dspark.engine.memory import expected_state_bytes, optimizer_state_elements, storage_bytes
from dspark.engine.optimizer_guard import check_elementwise, guard_sharded_optimizer
from dspark.engine.optimizer_kernel import prefer_fused_kernel, skips_on_found_inf
from dspark.engine.param_groups import ParamGroupsFn, group_by_overrides
from dspark.engine.param_slot import ParamSlot
from dspark.engine.policy import precision_policy, sharding_policy
from dspark.engine.state_dict import load_sharded_state_dict, sharded_state_dict
from dspark.engine.step_observer import StepObserver, observed
from dspark.engine.trace import TraceSession, check_trace_args
from dspark.engine.zero3_guard import Zero3StateDictGuard
from dspark.engine.zero3_units import UnitPolicy, Zero3Scheduler
from dspark.tensor import DistTensor, Placement, Replicate, Shard
from dspark.tensor.fingerprint import batch_leaves

if TYPE_CHECKING:
    from dspark.checkpoint import CheckpointInfo

__all__ = ["Engine", "IncompatibleKeys"]

log = logging.getLogger(__name__)

OptimizerFactory = Callable[..., torch.optim.Optimizer]

# autograd's complaint when an op saw a freed (empty) zero3 parameter and its gradient has the full
# shape: "Function PowBackward0 returned an invalid gradient at index 0 - got [0] but expected
# shape compatible with [2]"
_SECOND_BACKWARD = re.compile(r"backward through the graph a second time")
_EMPTY_PARAMETER_GRADIENT = re.compile(r"invalid gradient at index \d+ - got \[0\]")

# How zero2/zero3 reduce gradient shards, per backend: a reduce-scatter where the backend has a good
# one (gloo's goes through an all-to-all, see [Note: reduce-scatter on gloo] in dspark.comm), else an
# all-reduce of the whole bucket, each rank keeping its rows.
_SHARDED_REDUCE = {"nccl": "reduce_scatter", "gloo": "reduce_scatter"}


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

    Every rank builds the same model (names, shapes, dtypes, ``requires_grad`` and buffers are
    checked at construction; parameters and buffers are then broadcast from rank 0), on a real device
    or under ``with torch.device("meta"):`` (the engine then materialises it with the modules'
    ``reset_parameters()``; zero3 one module at a time). ``engine.backward(loss)`` is called up to
    ``grad_accum_steps`` times, then ``engine.step()``: gradients are communicated during the last
    backward of the window (or in ``step()`` when the window ends early), and the update uses the mean
    over the window's micro-batches and all ranks. ``engine.backward(loss, weight=n)`` weighs each
    rank's loss by the ``n`` samples (or tokens) it averages over, for unequal local batches.

    Keyword arguments beyond the strategy and precision: ``param_groups(name, param) -> dict`` gives
    per-parameter optimizer options (weight-decay groups); ``zero3_units`` picks the modules zero3
    gathers together (module classes or a ``(name, module) -> bool`` predicate); ``sync_batchnorm``
    normalises BatchNorm layers with global batch statistics (one-process semantics on any backend);
    ``broadcast_buffers`` (default True) gives every rank rank 0's buffers before each training
    forward, as DDP does. On the first step, and every ``batch_check_every`` steps after, ranks
    compare fingerprints of their input batches: identical batches raise
    :class:`dspark.PlacementError` (``None`` turns it off; see :mod:`dspark.engine.batch_check`).
    ``trace_dir`` writes a PyTorch profiler trace per rank (``trace_dir/rank{R}.json``) of
    ``trace_steps=(warmup, active)`` steps, with the engine's phases and collectives named
    (:mod:`dspark.engine.trace`). ``step_stats()`` and ``audit()`` tell where
    the last step's time and this rank's memory went. On a CPU device the engine fixes glibc's malloc
    thresholds for the process, so that each step reuses the memory the last one freed instead of
    page-faulting it in again (:mod:`dspark.cpu_malloc`; ``DSPARK_CPU_MALLOC=default`` opts out).
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
        param_groups: ParamGroupsFn | None = None,
        zero3_units: UnitPolicy = None,
        sync_batchnorm: bool = False,
        broadcast_buffers: bool = True,
        batch_check_every: int | None = DEFAULT_BATCH_CHECK_EVERY,
        trace_dir: str | os.PathLike[str] | None = None,
        trace_steps: tuple[int, int] = (1, 2),
    ) -> None:
        _check_arguments(model, optimizer, grad_accum_steps, clip_grad_norm, bucket_mb, reduce_dtype,
                         param_groups, zero3_units)
        check_trace_args(trace_dir, trace_steps)
        self.strategy = sharding_policy(strategy)
        self.precision = precision_policy(precision)
        self.world = comm.get_world()
        if self.world.device.type == "cpu":
            cpu_malloc.tune_for_training()  # before the first step allocates: see dspark.cpu_malloc
            if self.precision.compute_dtype == torch.bfloat16 and self.world.rank == 0:
                _warn_emulated_bf16()
        self.grad_accum_steps = grad_accum_steps
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.bucket_mb = float(bucket_mb)
        self.reduce_dtype = reduce_dtype
        if loss_scaler is not None and not self.precision.loss_scaling:
            raise ValueError(f"loss_scaler={loss_scaler!r} with precision={self.precision.name!r}: only "
                             "fp16 scales its loss; pass precision='fp16', or leave loss_scaler out")
        self.loss_scaler = (loss_scaler or LossScaler()) if self.precision.loss_scaling else None
        self.last_grad_norm: float | None = None
        self._defer_host_reads = defers_host_reads(self.world.device)
        self.step_count = 0
        self._micro_step = 0
        self._weight_sum: float | None = None
        self._weight_unit: float | None = None   # fp16: see [Note: fp16 share of the batch]
        self._batch_size: int | None = None
        self._grads_bytes_held = 0
        self._in_backward = False
        self._synced = False  # this window's gradients are reduced and in place
        self._has_grads = False  # ... and hold something to apply (not every rank gave weight=0)
        n = self.world.world_size

        settings = {"strategy": self.strategy.name, "precision": self.precision.name,
                    "grad_accum_steps": grad_accum_steps,
                    "clip_grad_norm": self.clip_grad_norm, "bucket_mb": self.bucket_mb,
                    "reduce_dtype": str(reduce_dtype), "loss_scaler": repr(self.loss_scaler),
                    "param_groups": param_groups is not None, "zero3_units": zero3_units is not None,
                    "sync_batchnorm": sync_batchnorm, "broadcast_buffers": broadcast_buffers,
                    "batch_check_every": batch_check_every}
        _check_same_model_on_every_rank(model, self.world.rank, settings)
        named = _unique_params(model)
        trainable = [(names[0], p) for names, p in named if p.requires_grad]
        groups = self._agreed("param_groups", lambda: None if param_groups is None else
                              group_by_overrides(trainable, param_groups))
        self._shard_params = self.strategy.shard_params and n > 1
        self.module = model
        # identical input batches on two ranks raise PlacementError (see engine/batch_check.py)
        self.batch_check = BatchCheck(model, every=batch_check_every, step_count=lambda: self.step_count)
        slot_of: dict[int, ParamSlot] = {}
        self._agreed("placing the model on its device", lambda: self._place(model, named, slot_of))
        all_slots = [slot_of[id(p)] for _, p in named if id(p) in slot_of]
        self.slots = [s for s in all_slots if s.requires_grad]
        """The trainable parameters, one slot each (tied parameters share one)."""
        self._frozen_slots = [s for s in all_slots if not s.requires_grad]
        self._frozen_params = [(names[0], p) for names, p in named if not p.requires_grad]
        """Frozen at construction: a gradient on one later means it was unfrozen (not followed)."""
        if self.world.device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
            first = next(name for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm))
            raise ValueError(
                f"{'module ' + repr(first) if first else 'the model'} is an nn.SyncBatchNorm, which trains on GPUs only (its forward "
                "refuses CPU tensors): on CPU ranks keep the model's plain BatchNorm layers (leave out "
                "nn.SyncBatchNorm.convert_sync_batchnorm) and pass sync_batchnorm=True to dspark.Engine "
                "for statistics over the global batch")
        self._batchnorms = convert_batchnorm(model) if sync_batchnorm else []
        self._buffer_sync = None
        if broadcast_buffers and n > 1:
            skip = {id(b) for m in self._batchnorms for b in m.buffers(recurse=False)}
            self._buffer_sync = BufferSync(model, skip=skip)

        self._zero3: Zero3Scheduler | None = None
        self._zero3_guard: Zero3StateDictGuard | None = None
        if self._shard_params:
            self._zero3 = Zero3Scheduler(model, all_slots, policy=zero3_units,
                                         in_backward=lambda: self._in_backward)
            # model.state_dict() would hold empty tensors: see [Note: state dicts under zero3]
            self._zero3_guard = Zero3StateDictGuard(model, all_slots, rank=self.world.rank)
        elif self.strategy.shard_optimizer:
            # one rank's shard of a parameter is the whole parameter: zero3 on one rank keeps it in place
            for slot in self.slots:
                slot.view_shard_of_full()
        self.optimizer = self._agreed("building the optimizer",
                                      lambda: self._build_optimizer(optimizer, groups))
        _check_same_optimizer_on_every_rank(self.optimizer, self.world.rank)
        if self.strategy.shard_optimizer and n > 1:
            check_elementwise(self.optimizer, strategy=self.strategy.name, after_step=False)
        self._reducer: GradReducer | None = None
        if n > 1:
            sharded = self.strategy.shard_grads
            collective = _SHARDED_REDUCE.get(self.world.backend, "all_reduce") if sharded else "all_reduce"
            self._reducer = GradReducer(self.slots, sharded=sharded, collective=collective,
                                        bucket_mb=self.bucket_mb, wire_dtype=reduce_dtype,
                                        rank=self.world.rank, num_ranks=n, device=self.world.device)
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._grad_ready_hook(s))
                       for s in self.slots]
        if self.strategy.shard_optimizer and n > 1:  # see [Note: a rank's optimizer state dict]
            self._hooks.extend(guard_sharded_optimizer(self.optimizer, rank=self.world.rank, world_size=n,
                                                       strategy=self.strategy.name))
        self._hooks.append(model.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True))
        self._last_batch: BatchRecord | None = None
        trace = None if trace_dir is None else TraceSession(
            trace_dir, rank=self.world.rank, warmup=trace_steps[0], active=trace_steps[1],
            device=self.world.device)
        self._observer = StepObserver(self.world.device, rank=self.world.rank, trace=trace)

    # -- construction ----------------------------------------------------------------------------
    def _agreed(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on this rank, then agree with every rank that it succeeded everywhere."""
        try:
            out = fn()
        except Exception as exc:
            agree(exc, what=what)
            raise
        agree(None, what=what)
        return out

    def _place(self, model: nn.Module, named: list[tuple[list[str], nn.Parameter]],
               slot_of: dict[int, ParamSlot]) -> None:
        """Give the model real storage on this rank's device, equal to rank 0's; zero3 keeps only this
        rank's rows of each parameter."""
        rank, n, device = self.world.rank, self.world.world_size, self.world.device
        names_of = {id(p): names for names, p in named}
        keep = (lambda p: True) if self._shard_params else (lambda p: p.requires_grad)

        def new_slot(p: nn.Parameter) -> ParamSlot:
            slot = ParamSlot(names_of[id(p)], p, rank=rank, num_ranks=n)
            slot_of[id(p)] = slot
            return slot

        if has_meta_tensors(model):
            def on_final(name: str, p: nn.Parameter) -> None:
                if n > 1:
                    broadcast_tensors([p.data])  # rank 0's values, whatever each rank's seed
                if keep(p):
                    slot = new_slot(p)
                    if self._shard_params:
                        slot.shard_and_free_full()

            materialize(model, device, on_final)
            if n > 1:
                broadcast_tensors(list(model.buffers()))
            return
        model.to(device)
        if n > 1:
            broadcast_tensors([p.detach() for _, p in named] + list(model.buffers()))
        for _, p in named:
            if keep(p):
                slot = new_slot(p)
                if self._shard_params:
                    slot.shard_and_free_full()

    def _build_optimizer(self, factory: OptimizerFactory,
                         groups: list[tuple[dict[str, Any], list[int]]] | None) -> torch.optim.Optimizer:
        def opt_param(slot: ParamSlot) -> nn.Parameter:
            p = slot.opt_param if self.strategy.shard_optimizer else slot.param
            if p is None:
                raise AssertionError(f"{slot.name}: no tensor for the optimizer")
            return p

        if groups is None:
            mine = [opt_param(s) for s in self.slots if opt_param(s).numel() > 0]
            # a rank that owns no row of any parameter (a small model on many ranks) still gets an
            # optimizer, with one empty group: PyTorch refuses an empty parameter list
            built = factory(mine if mine else [{"params": []}])
        else:
            built = factory([{"params": [opt_param(self.slots[i]) for i in indices
                                         if opt_param(self.slots[i]).numel() > 0], **overrides}
                             for overrides, indices in groups])
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a "
                            "torch.optim.Optimizer")
        given = {id(opt_param(s)) for s in self.slots}
        foreign = [p for group in built.param_groups for p in group["params"] if id(p) not in given]
        if foreign:
            names = {id(p): name for name, p in self.module.named_parameters()}
            shown = ", ".join(names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in foreign[:3])
            raise ValueError(
                f"the optimizer factory built an optimizer over {len(foreign)} tensor(s) it was not "
                f"given ({shown}{' ...' if len(foreign) > 3 else ''}): it must optimise the parameters "
                f"it is called with, which are the tensors the engine updates (under "
                f"{self.strategy.name!r}, this rank's rows of each parameter). Pass "
                f"functools.partial(torch.optim.AdamW, lr=...), or lambda params: "
                f"torch.optim.AdamW(params, ...), not one that reads model.parameters()")
        if groups is not None and self.world.rank == 0:
            _warn_unknown_group_options(built, groups, self.slots)
        if prefer_fused_kernel(built):
            log.debug("rank %d: %s steps with its fused kernel", self.world.rank, type(built).__name__)
        return built

    # -- forward / backward ----------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.world.device.type, dtype=self.precision.compute_dtype)

    @outside_compile
    def _root_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._in_backward or not torch.is_grad_enabled():
            return
        leaves = batch_leaves((args, kwargs))
        if leaves and leaves[0].dim() > 0:
            self._batch_size = (self._batch_size or 0) + int(leaves[0].shape[0])
        if leaves:
            self._last_batch = record_batch(leaves)
        if self._buffer_sync is not None and module.training:
            self._buffer_sync.before_forward()

    @observed("forward")
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (under autocast for bf16/fp16)."""
        try:
            with self._autocast(), self._saving_parameters():
                return self.module(*args, **kwargs)
        except RuntimeError as exc:
            if self._zero3 is None:
                raise
            freed = [s.name for s in self.slots if not s.gathered]
            self._zero3.end_backward()  # a failed forward leaves units half-gathered: start clean
            if "shape" not in str(exc) and "size" not in str(exc):
                raise
            raise RuntimeError(
                f"{exc}\n[DSpark zero3] parameters are whole only while the unit that owns them runs "
                f"its forward (units are the children of nn.ModuleList/nn.Sequential, or those chosen "
                f"with zero3_units=; the root owns the rest). A parameter read outside its unit, e.g. by "
                f"the parent's forward, is an empty tensor there; freed now: {', '.join(freed[:5])}"
                f"{' ...' if len(freed) > 5 else ''}. Move that use into the unit's forward, or use "
                "strategy='zero2'.") from exc

    def _saving_parameters(self) -> contextlib.AbstractContextManager[Any]:
        if self._zero3 is None or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return self._zero3.saving_parameters_by_reference()

    def _grad_ready_hook(self, slot: ParamSlot) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._in_backward:
                raise RuntimeError(
                    f"rank {self.world.rank}: gradients of {slot.name} were computed outside "
                    "engine.backward(loss) (a plain loss.backward()?); call engine.backward(loss) so "
                    "that the engine can scale, accumulate and reduce them across ranks")
            if self._reducer is not None:
                self._reducer.on_grad(slot)
            else:
                slot.arrivals += 1
            if self._zero3 is not None:
                self._zero3.on_grad_accumulated(slot)
        return hook

    def backward(self, loss: torch.Tensor, *, weight: float | int | torch.Tensor | None = None) -> None:
        """Backpropagate ``loss`` (the mean loss of this rank's micro-batch). The update averages the
        window's ``grad_accum_steps`` micro-batches over all ranks with equal weights; with
        ``weight=n`` (the samples or tokens this rank's loss averages over) it is the mean over all of
        them instead, as one process on the whole batch computes it (``weight=0``: this rank
        contributes nothing). Gradients are reduced across ranks during the window's last backward.

        Example::

            n = int((labels != -100).sum())
            engine.backward(loss, weight=n)
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        w = _check_weight(weight)
        if self._micro_step >= self.grad_accum_steps:
            raise RuntimeError(f"rank {self.world.rank}: backward() called {self._micro_step + 1} times "
                               f"with grad_accum_steps={self.grad_accum_steps}; call engine.step() after "
                               f"at most {self.grad_accum_steps} backward() calls")
        if self._micro_step > 0 and (w is None) != (self._weight_sum is None):
            raise ValueError(f"rank {self.world.rank}: weight= must be given on every backward() of an "
                             "accumulation window or on none")
        # Refused above with nothing changed: the window goes on, and so does its step breakdown.
        self._backward(loss, w)

    @observed("backward")
    def _backward(self, loss: torch.Tensor, w: float | None) -> None:
        self.batch_check.before_backward()  # raises on every rank, before any state changes
        self._micro_step += 1
        sync = self._micro_step == self.grad_accum_steps
        if w is None:
            scale = 1.0 / self.grad_accum_steps
        else:
            scale = w
            self._weight_sum = (self._weight_sum or 0.0) + w
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale * self._fp16_unit(w)
        if self._reducer is not None:
            self._reducer.begin_backward(sync=sync)
        else:
            for slot in self.slots:
                slot.arrivals = 0
        self._in_backward = True
        try:
            if w != 0.0:
                (loss * scale if scale != 1.0 else loss).backward()
            elif self._zero3 is not None:
                self._zero_weight_backward(loss)
        except BaseException as exc:
            self._end_window()
            if _SECOND_BACKWARD.search(str(exc)):
                raise RuntimeError(
                    f"{exc}\n[DSpark] engine.backward() ran through a graph an earlier backward had "
                    "already freed (retain_graph is not an engine option: each engine.backward() is a "
                    "micro-batch of the accumulation window). For several losses of one forward, "
                    "backpropagate their sum once: engine.backward(loss_a + loss_b)") from exc
            if self._zero3 is not None and _EMPTY_PARAMETER_GRADIENT.search(str(exc)):
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
            self._in_backward = False
            if self._zero3 is not None:
                self._zero3.end_backward()
        if sync:
            self._sync_grads()

    def _fp16_unit(self, weight: float | None) -> float:
        """[Note: fp16 share of the batch] One process on the whole batch backpropagates its mean loss
        times the loss scale: each sample's gradient carries ``scale / B``. A rank's loss is the mean
        over its own ``B / N`` samples, so scaled alone it would carry ``N`` times that, and fp16
        would overflow ``N`` times sooner than in one process (and with ``weight=n``, a loss times a
        token count would overflow at once). Under fp16 each backward is therefore scaled by this
        rank's share of the global batch: ``1 / N`` without weights; with weights, ``weight / S``,
        ``S`` being the sum over ranks of the window's first weights that are not all zero (one
        all-reduce of one number per window). The unit is the same on every rank, so the reduction
        stays a plain average, and the optimizer sees the gradient divided by it again."""
        if weight is None:
            self._weight_unit = 1.0 / self.world.world_size
        elif self._weight_unit is None:
            total = torch.tensor([weight], dtype=torch.float64, device=self.world.device)
            comm.all_reduce(total, label="dspark.fp16_weight.all_reduce")
            first = float(total.item())
            if first > 0:
                self._weight_unit = 1.0 / first
        return 1.0 if self._weight_unit is None else self._weight_unit

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

    def _sync_grads(self) -> None:
        """The window's gradients, averaged over ranks, where the optimizer reads them."""
        weights = StepWeights(micro_steps=self._micro_step, accum_steps=self.grad_accum_steps,
                              weight_sum=self._weight_sum, batch_size=self._batch_size,
                              loss_scale=1.0 if self.loss_scaler is None
                              else self.loss_scaler.scale * (self._weight_unit or 1.0))
        unfrozen = [name for name, p in self._frozen_params if p.grad is not None]
        if unfrozen:
            for _, p in self._frozen_params:
                p.grad = None
            self._end_window()
            raise RuntimeError(
                f"rank {self.world.rank}: {', '.join(unfrozen[:4])}{' ...' if len(unfrozen) > 4 else ''} "
                f"got a gradient but was frozen (requires_grad=False) when the engine was built: the "
                "engine reduces and steps only the parameters trainable at construction. To unfreeze "
                "during training, build a new engine after requires_grad_(True), or build it with the "
                "parameters trainable and param_groups giving them lr=0 until they are to train")
        try:
            if self._reducer is not None:
                self._has_grads = self._reducer.end_backward(weights)
            else:
                self._has_grads = self._finish_single_rank(weights)
        except BaseException:
            self._end_window()
            raise
        self._synced = True
        for slot in self.slots:
            if slot.opt_param is None:
                continue
            if self.strategy.shard_grads:
                grad = slot.shard_grad_rows()
                slot.opt_param.grad = None if grad is None else grad
            else:
                full = slot.param.grad
                slot.opt_param.grad = None if full is None else slot.rows_view(full)[slot.start:slot.stop]
        self._grads_bytes_held = storage_bytes(self._grad_tensors())

    def _finish_single_rank(self, weights: StepWeights) -> bool:
        """One rank: nothing to reduce, so no bucket copies; the shard is the whole gradient."""
        if weights.weight_sum is not None:
            if weights.weight_sum <= 0:
                return False
            post = 1.0 / weights.weight_sum
        else:
            post = weights.accum_steps / weights.micro_steps
        post /= weights.loss_scale
        if post != 1.0:
            # one multi-tensor kernel per dtype instead of one launch per parameter: on a GPU, fp16's
            # unscale of ResNet-50's 161 gradients was 160 extra launches a step
            grads = [slot.param.grad for slot in self.slots if slot.param.grad is not None]
            if grads:
                torch._foreach_mul_(grads, post)
        for slot in self.slots:
            grad = slot.param.grad
            if self.strategy.shard_grads:
                slot.shard_grad = None if grad is None else _memory_order(slot, grad)
                slot.param.grad = None
        return True

    def _grad_tensors(self) -> Iterator[torch.Tensor | None]:
        for slot in self.slots:
            yield slot.shard_grad if self.strategy.shard_grads else slot.param.grad

    def _end_window(self) -> None:
        """After the step, or a failure: drop this window's gradients and state, so the next window
        starts clean."""
        self._micro_step = 0
        self._weight_sum = None
        self._weight_unit = None
        self._batch_size = None
        self._synced = False
        if self._reducer is not None:
            self._reducer.end_window()
        self._zero_grads()

    # -- optimizer step --------------------------------------------------------------------------
    @observed("optimizer")
    def step(self) -> bool:
        """Apply the optimizer to the window's averaged gradients (after 1 to ``grad_accum_steps``
        ``backward()`` calls; a shorter window, e.g. at the end of an epoch, is reduced here). Returns
        False when the step was skipped: an fp16 overflow (inf/nan in the gradients on any rank;
        parameters and optimizer state untouched, the loss scale lowered), or ``weight=0`` on every
        rank."""
        if self._micro_step == 0:
            raise RuntimeError(f"rank {self.world.rank}: step() before backward(); call "
                               "engine.backward(loss) first")
        try:
            if not self._synced:
                self._sync_grads()
            applied = self._apply_update()
            if self._reducer is not None:
                self._reducer.after_step()
            return applied
        finally:
            self._end_window()

    def _apply_update(self) -> bool:
        if not self._has_grads:
            log.warning("rank %d: every rank gave weight=0: nothing to average, step skipped",
                        self.world.rank)
            return False
        if self.loss_scaler is None and self.clip_grad_norm is None:
            self.optimizer.step()
            return self._after_optimizer_step()
        if self._defer_host_reads and (self.loss_scaler is None or skips_on_found_inf(self.optimizer)):
            return self._update_reading_the_norm_after()
        norm = self._global_grad_norm()
        self.last_grad_norm = norm  # inf or nan on an overflow, as clip_grad_norm_ after unscale_
        if self.loss_scaler is not None and self._fp16_overflowed(norm):
            return False
        if self.clip_grad_norm is not None:
            self._clip_to(self.clip_grad_norm, norm)
        self.optimizer.step()
        return self._after_optimizer_step()

    def _update_reading_the_norm_after(self) -> bool:
        """The step with its one host read after the optimizer's kernels are queued (see [Note: the
        step's one host read] in :mod:`dspark.engine.host_read`): the clip coefficient stays on the
        device, an fp16 overflow skips the fused kernel's update on the device, and the host waits
        only for the norm."""
        total = self._grad_norm_squared()
        read = DeferredRead(total)
        if self.clip_grad_norm is not None:
            coef = (self.clip_grad_norm / (total.sqrt() + 1e-6)).clamp_(max=1.0).float().reshape(())
            grads = [g for g in self._owned_grads() if g is not None]
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
        self._gather_after_optimizer_step()
        norm = math.sqrt(read.value())
        self.last_grad_norm = norm
        if self.loss_scaler is not None and self._fp16_overflowed(norm):
            return False
        self.step_count += 1
        return True

    def _fp16_overflowed(self, norm: float) -> bool:
        """Update the loss scale from this step's norm; True (with a warning) on an overflow."""
        assert self.loss_scaler is not None
        overflow = not math.isfinite(norm)
        self.loss_scaler.update(found_overflow=overflow)
        if overflow:
            log.warning("rank %d: fp16 gradients overflowed; step skipped, loss scale now %g",
                        self.world.rank, self.loss_scaler.scale)
        return overflow

    def _after_optimizer_step(self) -> bool:
        """The end of an applied step: the rows gathered, the step counted."""
        self._gather_after_optimizer_step()
        self.step_count += 1
        return True

    def _gather_after_optimizer_step(self) -> None:
        """zero1/zero2: check the sharded optimizer's state once, and all-gather the updated rows."""
        if self.step_count == 0 and self.strategy.shard_optimizer and self.world.world_size > 1:
            self._agreed("checking the optimizer's state after its first step",  # one small gather, once
                         lambda: check_elementwise(self.optimizer, strategy=self.strategy.name, after_step=True))
        if self.strategy.shard_optimizer and not self._shard_params and self.world.world_size > 1:
            self._gather_updated_rows()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the window's reduced gradients so that their global L2 norm is at most ``max_norm``
        and return the norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does in one
        process; ``max_norm=float("inf")`` only measures it. For loops that clip (or log the norm)
        themselves between ``engine.backward`` and ``engine.step``: under zero2 and zero3 the
        model's parameters hold no gradient (each rank keeps its shard), so PyTorch's own function
        would see none. Call it on every rank (sharded gradients sum their squares across ranks),
        after the window's last ``backward()``. ``clip_grad_norm=`` does the same inside ``step()``.

        Example::

            engine.backward(loss)
            norm = engine.clip_grad_norm_(1.0)
            engine.step()
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm={max_norm!r} must be a positive number (float('inf') only "
                             "measures the norm)")
        if not self._synced:
            raise RuntimeError(
                f"rank {self.world.rank}: clip_grad_norm_() before the window's gradients are reduced "
                f"({self._micro_step} of grad_accum_steps={self.grad_accum_steps} backward() calls "
                "so far); call it after the window's last engine.backward() and before engine.step()")
        norm = self._global_grad_norm()
        self.last_grad_norm = norm
        self._clip_to(float(max_norm), norm)
        return norm

    def _clip_to(self, max_norm: float, norm: float) -> None:
        """Scale this rank's gradients by ``max_norm / norm`` when that is below 1, with
        ``clip_grad_norm_``'s epsilon."""
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            grads = [g for g in self._owned_grads() if g is not None]
            if grads:
                torch._foreach_mul_(grads, coef)

    def _owned_grads(self) -> list[torch.Tensor | None]:
        """The gradient tensors this rank holds: shards (zero2/3) or whole gradients (replicate, zero1;
        identical on every rank after the all-reduce)."""
        if self.strategy.shard_grads:
            return [s.shard_grad for s in self.slots]
        return [s.param.grad for s in self.slots]

    def _global_grad_norm(self) -> float:
        """The L2 norm of the whole gradient, as ``torch.nn.utils.clip_grad_norm_`` computes it in one
        process; inf or nan when any rank's gradient holds one. One host synchronisation."""
        return math.sqrt(float(self._grad_norm_squared().item()))

    def _grad_norm_squared(self) -> torch.Tensor:
        """The squared L2 norm of the whole gradient, a float64 tensor of one element on the device.
        Shards (zero2/3) sum their squares across ranks (padding rows are zero); whole gradients are
        equal everywhere and need no collective."""
        local = [g for g in self._owned_grads() if g is not None]
        total = torch.zeros(1, dtype=torch.float64, device=self.world.device)
        if local:  # one fused norm per tensor, as clip_grad_norm_ does; no float64 copies of gradients
            total += torch.stack(torch._foreach_norm(local)).double().pow(2).sum()
        if self.strategy.shard_grads and self.world.world_size > 1:
            comm.all_reduce(total)
        return total

    def _gather_updated_rows(self) -> None:
        """zero1/zero2: every rank updated its rows; all-gather them into the full parameters, one
        collective per bucket (one dtype each). At most two buckets are in flight, their buffers taken
        in turn from two pools of depth 2 (the reducer's kind), so the gather costs about two buckets
        of memory, not a second copy of the model, and the pools go when it ends (see [Note:
        gradients live in buckets])."""
        if self._reducer is None:
            return
        n, device = self.world.world_size, self.world.device
        sends, outs = BufferPool(), BufferPool()  # a buffer is reused only after its bucket landed
        inflight: collections.deque[tuple[GradBucket, torch.Tensor, comm.Handle]] = collections.deque()
        for bucket in self._reducer.buckets:
            if len(inflight) == 2:
                self._land_updated_rows(*inflight.popleft())
            seg = sum(s.shard_numel for s in bucket.slots)
            send = sends.take(bucket, bucket.dtype, seg, device)
            out = outs.take(bucket, bucket.dtype, n * seg, device)
            offset = 0
            for slot in bucket.slots:
                rows = slot.rows_view(slot.param.detach())[slot.start:slot.stop]
                slot.view_rows(send[offset:], slot.local_rows).copy_(rows)  # padding: never read
                offset += slot.shard_numel
            out = out.view(n, seg)
            inflight.append((bucket, out, comm.all_gather_into_tensor(
                out, send, async_op=True, label=f"dspark.bucket{bucket.index}.all_gather")))
        while inflight:
            self._land_updated_rows(*inflight.popleft())

    def _land_updated_rows(self, bucket: GradBucket, out: torch.Tensor, handle: comm.Handle) -> None:
        handle.wait()
        n, me = self.world.world_size, self.world.rank
        offset = 0
        for slot in bucket.slots:
            full = slot.rows_view(slot.param.detach())
            for r in range(n):
                if r == me:
                    continue
                start = min(r * slot.chunk, slot.rows)
                stop = min((r + 1) * slot.chunk, slot.rows)
                if stop > start:
                    full[start:stop].copy_(slot.view_rows(out[r, offset:], stop - start))
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

    def full_state_dict(self, *, rank0_only: bool = False, cpu: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers (rank 0's), by name as in ``model.state_dict()``.
        Collective: call it on every rank. zero3 gathers one unit at a time, so the peak is the result
        plus one unit. ``rank0_only=True`` returns the result on rank 0 and ``{}`` elsewhere;
        ``cpu=True`` puts it in CPU memory.

        Example::

            sd = engine.full_state_dict(rank0_only=True, cpu=True)
            if dspark.get_world().is_main:
                torch.save(sd, "model.pt")
        """
        keep = not rank0_only or self.world.rank == 0

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True) if cpu else t.detach().clone()

        self.sync_buffers()
        values: dict[str, torch.Tensor] = {}
        if self._zero3 is not None:
            for unit in self._zero3.units:
                todo = [s for s in unit.slots if s.names[0] not in values]
                self._zero3.gather_slots(todo)
                if keep:
                    for slot in todo:
                        for name in slot.names:
                            values[name] = own(slot.param)
                self._zero3.free_slots(todo)
        if not keep:
            return {}
        out: dict[str, torch.Tensor] = {}
        for name, value in self._module_state_dict().items():
            out[name] = values[name] if name in values else own(value)
        return out

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], *,
                             strict: bool = True) -> IncompatibleKeys:
        """Load a plain ``model.state_dict()`` (pretrained weights, every rank passing the same) into the
        engine, whatever its strategy: zero3 keeps this rank's rows. Optimizer state is untouched.
        ``strict=False`` ignores keys the model lacks and leaves missing ones as they are; a state
        dict none of whose keys is a name of the model is an error even then (nothing would load).
        Returns the missing and unexpected keys, as ``nn.Module.load_state_dict`` does.

        Example::

            engine.load_full_state_dict(torch.load("gpt2.pt", weights_only=True))
            missing, unexpected = engine.load_full_state_dict(backbone, strict=False)  # a new head
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
        self._check_between_steps("load_full_state_dict")
        expected = self._module_state_dict()
        slot_of = {name: s for s in (*self.slots, *self._frozen_slots) for name in s.names}
        missing = [k for k in expected if k not in state_dict and not (k in slot_of and any(
            n in state_dict for n in slot_of[k].names))]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise ValueError(f"load_full_state_dict: the state dict does not match the model: missing "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                             f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} (strict=False "
                             f"skips them){_prefix_fix(list(expected), list(state_dict))}")
        if state_dict and len(unexpected) == len(state_dict):
            raise ValueError(f"load_full_state_dict: none of the state dict's {len(state_dict)} keys is a "
                             f"name of the model (first: {unexpected[:3]}; the model's: "
                             f"{list(expected)[:3]}), so nothing would load"
                             f"{_prefix_fix(list(expected), list(state_dict))}")
        for name, current in expected.items():  # every value checked before any is copied
            if name not in state_dict:
                continue
            value = state_dict[name]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"load_full_state_dict: {name!r} is a {type(value).__name__} in the state "
                                "dict, not a tensor; nothing was loaded")
            slot = slot_of.get(name)
            shape = tuple(slot.shape) if slot is not None else tuple(current.shape)
            if tuple(value.shape) != shape:
                raise ValueError(f"load_full_state_dict: {name!r} has shape {tuple(value.shape)} in "
                                 f"the state dict but {shape} in the model; nothing was loaded")
        done: set[int] = set()
        with torch.no_grad():
            for name, current in expected.items():
                if name not in state_dict:
                    continue
                value = state_dict[name]
                slot = slot_of.get(name)
                if slot is not None:
                    if id(slot) in done:
                        continue
                    done.add(id(slot))
                    if slot.padded_shard is not None:
                        rows = slot.rows_view(value)[slot.start:slot.stop]
                        slot.padded_shard[: slot.local_rows].copy_(rows)
                        continue
                current.copy_(value)
        return IncompatibleKeys(missing, unexpected)

    def _module_state_dict(self) -> dict[str, Any]:
        """``self.module.state_dict(keep_vars=True)`` for the engine's own walks over names and
        buffers: under zero3 the module refuses it while its parameters are freed (see [Note: state
        dicts under zero3]); the parameters' entries here are then empty and must not be read."""
        guard = self._zero3_guard
        with guard.allowed() if guard is not None else contextlib.nullcontext():
            return self.module.state_dict(keep_vars=True)

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers now (collective; done before checkpoints and full state
        dicts, so that they never depend on which rank is asked)."""
        if self.world.world_size > 1:
            broadcast_tensors(list(self.module.buffers()))

    def sharded_state_dict(self) -> dict[str, Any]:
        """Everything the engine holds, as PyTorch's distributed checkpoint consumes it: live tensors,
        this rank's rows as ``Shard(0)`` DTensors (see [Note: sharded state dict] in
        :mod:`dspark.engine.state_dict`). ``engine.save`` is built on it; it can also go to
        ``torch.distributed.checkpoint`` directly.

        Example::

            import torch.distributed.checkpoint as dcp
            dcp.save(engine.sharded_state_dict(), checkpoint_id="ckpt/dcp")
        """
        return sharded_state_dict(self)

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install a structure like :meth:`sharded_state_dict`'s (each tensor this rank's rows or the
        whole tensor), whatever world size and strategy wrote it.

        Example::

            sd = engine.sharded_state_dict()
            dcp.load(sd, checkpoint_id="ckpt/dcp")
            engine.load_sharded_state_dict(sd)
        """
        self._check_between_steps("load_sharded_state_dict")
        load_sharded_state_dict(self, state)

    def save(self, path: str | os.PathLike[str], *, async_save: bool = False,
             extra: Mapping[str, Any] | None = None) -> Path:
        """Save a sharded checkpoint directory at ``path`` (see :mod:`dspark.checkpoint`): every rank
        writes its shards of the parameters and optimizer state; the step count, hyper-parameters,
        fp16 loss scale and every rank's random state come along, and the state of each ``extra``
        object (an LR scheduler, a ``dspark.DataLoader``: anything with ``state_dict()``). A
        checkpoint already at ``path`` is replaced only once the new one is complete. Collective: call
        it on every rank, between steps.

        ``async_save=True`` returns once the state is copied to CPU memory and writes it in the
        background; the next save, ``load`` and ``dspark.shutdown()`` wait for it
        (``dspark.checkpoint.wait_for_pending_save()`` waits explicitly and raises its error).

        Example::

            engine.save("ckpt/latest")
            engine.save("ckpt/step-100", async_save=True)   # training goes on while it is written
        """
        self._check_between_steps("save")
        # imported here: DCP is heavy to import and most runs never checkpoint
        from dspark.checkpoint import save_checkpoint

        return save_checkpoint(self, path, async_save=async_save, extra=extra)

    def load(self, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Load the checkpoint at ``path``, whatever world size and strategy wrote it: parameters,
        buffers, optimizer state (also before the first step), hyper-parameters, step count, fp16
        loss scale, this rank's random state, and each ``extra`` object's state (in place, with its
        ``load_state_dict``). Collective: call it on every rank, between steps. Returns what the
        checkpoint's ``dspark.json`` says (step, strategy, world size, versions).

        Example::

            info = engine.load("ckpt/latest", extra={"scheduler": sched, "loader": loader})
        """
        self._check_between_steps("load")
        from dspark.checkpoint import load_checkpoint

        return load_checkpoint(self, path, extra=extra)

    def _check_between_steps(self, what: str) -> None:
        if self._micro_step != 0:
            raise RuntimeError(f"rank {self.world.rank}: {what}() after {self._micro_step} of "
                               f"grad_accum_steps={self.grad_accum_steps} backward() calls; call it "
                               "between steps (after engine.step())")

    def memory_report(self) -> dict[str, int | str]:
        """Bytes this rank holds for parameters (trainable and frozen), gradients (as held at the end
        of the last backward) and optimizer state, measured from the tensors, next to what the
        strategy should hold. Frozen parameters count in ``params_bytes`` only: they have no gradient
        and no optimizer state (zero3 shards them too)."""
        n = self.world.world_size
        # frozen parameters have slots only where zero3 shards them; elsewhere they stay as built
        frozen: list[tuple[torch.Size, torch.dtype, torch.Tensor]] = (
            [(s.shape, s.dtype, s.padded_shard if s.padded_shard is not None else s.param)
             for s in self._frozen_slots] if self._shard_params else
            [(p.shape, p.dtype, p) for _, p in _unique_params(self.module) if not p.requires_grad])
        params_actual = storage_bytes([*(s.padded_shard if s.padded_shard is not None else s.param
                                         for s in self.slots), *(t for _, _, t in frozen)])
        opt_state = optimizer_state_elements(self.optimizer)

        def expect(shapes: Iterable[tuple[torch.Size, torch.dtype]]) -> dict[str, int]:
            return expected_state_bytes((torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes),
                                        self.strategy, rank=self.world.rank, num_ranks=n,
                                        optimizer_state=opt_state)

        expected = expect((s.shape, s.dtype) for s in self.slots)
        exp_params = expected["params"] + expect((shape, dtype) for shape, dtype, _ in frozen)["params"]
        exp_grads, exp_opt = expected["grads"], expected["optimizer"]
        opt_actual = storage_bytes(v for state in self.optimizer.state.values()
                                   for v in state.values() if isinstance(v, torch.Tensor))
        report: dict[str, int | str] = {
            "strategy": self.strategy.name,
            "num_ranks": n,
            "num_params": sum(s.numel for s in self.slots) + sum(math.prod(shape) for shape, _, _ in frozen),
            "num_trainable_params": sum(s.numel for s in self.slots),
            "params_bytes": params_actual,
            "params_bytes_expected": exp_params,
            "grads_bytes": self._grads_bytes_held,
            "grads_bytes_expected": exp_grads,
            "optimizer_bytes": opt_actual,
            "optimizer_bytes_expected": exp_opt,
            "comm_buffer_bytes": 0 if self._reducer is None else self._reducer.comm_buffer_bytes(),
        }
        report["total_bytes"] = params_actual + self._grads_bytes_held + opt_actual
        report["total_bytes_expected"] = exp_params + exp_grads + exp_opt
        return report

    def step_stats(self) -> dict[str, float]:
        """Where this rank's last step went, in milliseconds: ``step_ms``, ``forward_ms``,
        ``backward_ms``, ``comm_exposed_ms`` (waiting on communication that compute did not hide),
        ``optimizer_ms``, ``data_ms`` (from the previous ``step()`` to this step's first forward) and
        ``compute_ms`` (forward + backward + optimizer without the waits: what to compare across
        ranks to find a straggler). See [Note: step breakdown] in :mod:`dspark.engine.step_observer`.
        On CUDA this synchronises with the last step's events; nothing else does.

        Example::

            engine.step()
            stats = engine.step_stats()   # {"step_ms": 41.8, "forward_ms": 12.1, ...}
        """
        return self._observer.step_stats()

    def audit(self) -> list[dict[str, Any]]:
        """Every tensor this rank holds (parameters, gradients, optimizer state, the last input batch)
        with its placement, ``bytes`` held, ``expected_bytes`` its placement needs and ``factor``
        between them; see [Note: replication audit] in :mod:`dspark.engine.audit`. Collective: call it
        on every rank.

        Example::

            from dspark.engine.audit import format_audit
            print(format_audit(engine.audit()))  # input batch: 2.0x a 1/2 share, replicated on every rank
        """
        return audit_rows(module=self.module, slots=(*self.slots, *self._frozen_slots),
                          strategy=self.strategy, params_sharded=self._shard_params,
                          buckets=[] if self._reducer is None else self._reducer.buckets,
                          optimizer=self.optimizer, batch=self._last_batch, rank=self.world.rank,
                          num_ranks=self.world.world_size, device=self.world.device)

    def close(self) -> None:
        """Remove the engine's hooks (the module keeps working as a plain module unless zero3) and stop
        its trace, if one is still recording."""
        self._observer.close()
        self._last_batch = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.batch_check.remove()
        if self._zero3 is not None:
            self._zero3.remove_hooks()
        if self._zero3_guard is not None:
            self._zero3_guard.remove()
        restore_batchnorm(self._batchnorms)
        self._batchnorms = []


class IncompatibleKeys(NamedTuple):
    """What :meth:`Engine.load_full_state_dict` did not match (as ``nn.Module.load_state_dict``)."""

    missing_keys: list[str]
    """Names of the model the state dict has no value for (left as they were)."""
    unexpected_keys: list[str]
    """Keys of the state dict that name nothing in the model (ignored)."""


def _prefix_fix(expected: list[str], given: list[Any]) -> str:
    """A hint when the two key sets differ only by a leading name: a checkpoint saved from a DDP or
    ``torch.compile`` wrapper (``module.``, ``_orig_mod.``) or from a model held inside another."""
    names = [k for k in given if isinstance(k, str)]
    if not names or not expected:
        return ""
    want = set(expected)
    for prefix in {k.split(".", 1)[0] + "." for k in names if "." in k}:
        if all(k.startswith(prefix) for k in names) and {k[len(prefix):] for k in names} <= want:
            return (f". Every key of the state dict starts with {prefix!r} (saved from a wrapper, e.g. "
                    f"DDP's 'module.'): strip it, {{k.removeprefix({prefix!r}): v for k, v in sd.items()}}")
    for prefix in {k.split(".", 1)[0] + "." for k in expected if "." in k}:
        if all(k.startswith(prefix) for k in expected) and {prefix + k for k in names} <= want:
            return (f". Every name of the model starts with {prefix!r} (the engine wraps a wrapper, e.g. "
                    f"torch.compile's '_orig_mod.'): add it, {{{prefix!r} + k: v for k, v in sd.items()}}")
    return ""


def defers_host_reads(device: torch.device) -> bool:
    """Whether the step reads the gradient norm only after queueing the optimizer (see [Note: the
    step's one host read] in :mod:`dspark.engine.host_read`): on a GPU. A CPU has no queue to keep
    full, and there the clip's skip when the norm is below ``max_norm`` saves a pass over the
    gradients. (The tests switch it on for CPU ranks, to run the GPU's order of work there.)"""
    return device.type == "cuda"


def _memory_order(slot: ParamSlot, grad: torch.Tensor) -> torch.Tensor:
    if tuple(grad.stride()) == slot.strides:
        return grad.as_strided((slot.numel,), (1,))
    flat = torch.empty(slot.numel, dtype=grad.dtype, device=grad.device)
    slot.copy_to_flat(flat, grad)
    return flat


def _unique_params(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """``(names, param)`` for every distinct parameter, in ``named_parameters()`` order (tied ones list
    every name)."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [(names[k], params[k]) for k in params]


def _first_difference(what: str, everyone: list[dict[str, Any]], rank: int, fix: str) -> None:
    """Raise ``ValueError`` naming the first key whose value differs from rank 0's."""
    for other, theirs in enumerate(everyone[1:], start=1):
        for key in dict.fromkeys([*everyone[0], *theirs]):
            a, b = everyone[0].get(key, "(not set)"), theirs.get(key, "(not set)")
            if a != b:
                raise ValueError(f"rank {rank}: {what} differ between ranks: {key}={a!r} on rank 0 but "
                                 f"{b!r} on rank {other}. {fix}")


def _warn_emulated_bf16() -> None:
    """bf16 on a CPU without native bf16 instructions (AVX2 only: no AVX512-BF16, no AMX) runs
    emulated: a 2-core AMD EPYC VM with AVX2 times a bf16 matmul at 404 ms against 9.4 ms in fp32
    (``dspark.bench.cpu_precision.cpu_matmul_ms``), so a step looks hung. Said once, on rank 0."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return  # this PyTorch cannot tell: say nothing rather than guess
    if not native:
        warnings.warn(
            f"precision='bf16' on a CPU without native bf16 instructions (capability "
            f"{torch.backends.cpu.get_cpu_capability()}, no AVX512-BF16 or AMX): PyTorch emulates "
            "it, and its matmuls can run 10-40x slower than fp32. Pass precision='fp32' on this "
            "machine (dspark bench does so for its CPU presets).", stacklevel=3)


def _warn_unknown_group_options(optimizer: torch.optim.Optimizer,
                                groups: list[tuple[dict[str, Any], list[int]]],
                                slots: list[ParamSlot]) -> None:
    """A ``param_groups`` override the optimizer has no option for (``{"lrr": 0.1}``) is kept in
    its group and read by nobody, as PyTorch does; a typo there silently trains with the default,
    so it is named once (a key of the user's own, read by their scheduler, is still allowed)."""
    known = set(optimizer.defaults)
    for overrides, indices in groups:
        unknown = sorted(k for k in overrides if k not in known)
        if unknown:
            names = [slots[i].name for i in indices[:3]]
            warnings.warn(
                f"param_groups gave {', '.join(map(repr, unknown))} to {', '.join(names)}"
                f"{' ...' if len(indices) > 3 else ''}, which {type(optimizer).__name__} has no "
                f"option for (its options: {', '.join(sorted(known))}); the value is kept in the "
                "group but the optimizer does not read it. A typo?", stacklevel=4)


def _check_same_optimizer_on_every_rank(optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Every rank's factory built the same optimizer: class, group count and each group's options
    (a learning rate read from a per-rank config would make replicas drift apart silently)."""
    mine: dict[str, Any] = {"optimizer": type(optimizer).__name__, "groups": len(optimizer.param_groups)}
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                # other objects by type alone: their repr may hold a per-process address
                mine[f"param_groups[{i}][{key!r}]"] = (value.tolist() if isinstance(value, torch.Tensor)
                                                       else value if isinstance(value, (int, float, str, bool,
                                                                                       type(None), tuple))
                                                       else f"<{type(value).__name__}>")
    _first_difference("the optimizers", comm.all_gather_object(mine), rank,
                      "Build the optimizer with the same options on every rank")


def _check_same_model_on_every_rank(model: nn.Module, rank: int, settings: dict[str, Any]) -> None:
    """Every rank passed the same engine ``settings`` and built the same model: parameters (name,
    shape, dtype, requires_grad) and buffers (name, shape, dtype). A mismatch names the first
    difference instead of hanging, or training diverged replicas, later. One collective."""
    mine = [("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
            for name, p in model.named_parameters()]
    mine += [("buffer", name, tuple(b.shape), str(b.dtype), False) for name, b in model.named_buffers()]
    gathered = comm.all_gather_object((settings, mine))
    _first_difference("the dspark.Engine arguments", [g[0] for g in gathered], rank,
                      "Pass the same arguments on every rank")
    everyone = [g[1] for g in gathered]
    reference = everyone[0]
    for other, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                def fmt(entry: Any) -> str:
                    if entry is None:
                        return "nothing"
                    kind, name, shape, dtype, grad = entry
                    req = ", requires_grad" if grad else (", frozen" if kind == "parameter" else "")
                    return f"{kind} {name} {shape} {dtype}{req}"
                raise ValueError(
                    f"rank {rank}: the model differs between ranks, so data-parallel training cannot "
                    f"start: entry #{i} is {fmt(a)} on rank 0 but {fmt(b)} on rank {other}. Build the "
                    "same model on every rank (and freeze the same parameters)")


def _check_weight(weight: float | int | torch.Tensor | None) -> float | None:
    if weight is None:
        return None
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(f"weight must be a number or a one-element tensor, got shape {tuple(weight.shape)}")
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"weight={weight!r} must be a finite number >= 0 (the samples or tokens this "
                         "rank's loss averages over)")
    return float(weight)


def _check_arguments(model: Any, optimizer: Any, grad_accum_steps: Any, clip_grad_norm: Any,
                     bucket_mb: Any, reduce_dtype: Any, param_groups: Any, zero3_units: Any) -> None:
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
    if param_groups is not None and not callable(param_groups):
        raise TypeError(f"param_groups must be a function (name, param) -> dict of optimizer options, "
                        f"got {type(param_groups).__name__}")
    if zero3_units is not None and not callable(zero3_units):
        classes = zero3_units if isinstance(zero3_units, (list, tuple)) else None
        if classes is None or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"zero3_units={zero3_units!r} must be a list of nn.Module classes or a "
                            "function (name, module) -> bool")
