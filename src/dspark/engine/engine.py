"""``Engine``: data-parallel training of one model on every rank, with the ZeRO stage as policy.

One code path serves every strategy (see :mod:`dspark.engine.policy`). This file wires the parts and
holds the public API; each concern lives in its own module:

* construction: :mod:`~dspark.engine.validation` (the arguments, the same model and optimizer on
  every rank), :mod:`~dspark.engine.build` (the model on its device, zero3's shards, the optimizer);
* forward: the inputs recorded once (:mod:`~dspark.engine.inputs`), compute under autocast for
  bf16/fp16 with fp32 master weights, zero3 gathering each unit just in time
  (:mod:`~dspark.engine.zero3_units`), BatchNorm buffers following rank 0 as in DDP
  (:mod:`~dspark.engine.buffer_sync`) or global batch statistics (:mod:`~dspark.engine.global_batchnorm`);
* backward: :mod:`~dspark.engine.backward` over the accumulation window's state
  (:mod:`~dspark.engine.window`); gradients reduced in single-dtype buckets launched from autograd
  hooks while backward runs (:mod:`~dspark.engine.grad_reducer`, :mod:`~dspark.engine.grad_bucket`);
* the update: norm, clipping, fp16's overflow skip and the optimizer (:mod:`~dspark.engine.update`),
  then zero1/zero2 all-gather the updated rows (the reducer's buckets);
* state: :mod:`~dspark.engine.state_dict` (full and sharded), :mod:`~dspark.engine.memory` and
  :mod:`~dspark.engine.audit` (what a rank holds), :mod:`~dspark.engine.step_observer` (where a step
  went).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dspark import comm, cpu_malloc
from dspark.engine.agreement import agreed
from dspark.engine.audit import audit_rows
from dspark.engine.auto import AutoRequest, check_memory_budget, resolve_auto
from dspark.engine.backward import BackwardPass
from dspark.engine.batch_check import DEFAULT_BATCH_CHECK_EVERY, BatchCheck
from dspark.engine.buffer_sync import BufferSync, broadcast_tensors
from dspark.engine.build import OptimizerFactory, build_optimizer, place_model, shard_parameters
from dspark.engine.global_batchnorm import convert_batchnorm, restore_batchnorm
from dspark.engine.grad_reducer import GradReducer, LocalReducer
from dspark.engine.inputs import ForwardInputs, InputRecorder
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.memory import memory_report
from dspark.engine.optimizer_guard import check_elementwise, guard_sharded_optimizer
from dspark.engine.param_groups import ParamGroupsFn, group_by_overrides
from dspark.engine.param_slot import ParamSlot
from dspark.engine.policy import precision_policy, sharding_policy
from dspark.engine.pretrained import load_from_rank, load_pretrained, save_pretrained
from dspark.engine.state_dict import IncompatibleKeys, StateDicts
from dspark.engine.step_observer import StepObserver, observed
from dspark.engine.trace import TraceSession, check_trace_args
from dspark.engine.update import Update
from dspark.engine.validation import (
    check_arguments,
    check_no_sync_batchnorm_on_cpu,
    check_same_model_on_every_rank,
    check_same_optimizer_on_every_rank,
    unique_params,
    warn_emulated_bf16,
)
from dspark.engine.weights import KeyMap
from dspark.engine.window import StepTag, Window, check_in_step
from dspark.engine.zero3_units import UnitPolicy
from dspark.tensor import DistTensor, Placement

if TYPE_CHECKING:
    from dspark.checkpoint import CheckpointInfo

__all__ = ["Engine", "IncompatibleKeys"]

log = logging.getLogger(__name__)

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
    checked at construction; parameters and buffers are then broadcast from rank 0), on a real device,
    under ``with dspark.meta_init():`` (the engine replays the model's own initialisation exactly,
    zero3 one parameter at a time) or under ``with torch.device("meta"):`` (materialised with the
    modules' ``reset_parameters()``, refused when the model initialises elsewhere). ``engine.backward(loss)`` is called up to
    ``grad_accum_steps`` times, then ``engine.step()``: gradients are communicated during the last
    backward of the window (or in ``step()`` when the window ends early), and the update uses the mean
    over the window's micro-batches and all ranks. ``engine.backward(loss, weight=n)`` weighs each
    rank's loss by the ``n`` samples (or tokens) it averages over, for unequal local batches.

    ``strategy="auto"`` plans the model on this world and takes the fastest strategy whose predicted
    peak fits ``memory_budget`` bytes per rank (default: the device's memory less a margin; on a CPU
    the host's available memory over its local ranks), the same on every rank; rank 0 logs the plan
    table and ``engine.plan`` keeps it (see :mod:`dspark.plan.auto`).

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
    ``skip_nonfinite`` (default True) skips a step whose loss or gradient norm is not finite on every
    rank; ``max_nonfinite_skips`` such steps in a row raise. Every argument, what runs under the
    engine's precision, and the checks that keep ranks in step: docs/engine.md.
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
        memory_budget: int | None = None,
        skip_nonfinite: bool = True,
        max_nonfinite_skips: int | None = 20,
    ) -> None:
        check_arguments(model, optimizer, grad_accum_steps, clip_grad_norm, bucket_mb, reduce_dtype,
                        param_groups, zero3_units, skip_nonfinite, max_nonfinite_skips)
        check_trace_args(trace_dir, trace_steps)
        self.world = comm.get_world()
        self.plan: Any = None
        """``strategy="auto"``: the :class:`dspark.plan.Plan` the strategy was chosen from; else None."""
        if strategy == "auto":  # see [Note: auto without a circle] in dspark.engine.auto
            strategy, self.plan = resolve_auto(AutoRequest(
                model=model, optimizer=optimizer, precision=str(precision), bucket_mb=float(bucket_mb),
                memory_budget=check_memory_budget(memory_budget), world=self.world))
        elif memory_budget is not None:
            raise ValueError(f"memory_budget={memory_budget!r} is what strategy='auto' must fit in; "
                             f"with strategy={strategy!r} leave it out, or pass strategy='auto'")
        self.strategy = sharding_policy(strategy)
        self.precision = precision_policy(precision)
        if self.world.device.type == "cpu":
            cpu_malloc.tune_for_training()  # before the first step allocates: see dspark.cpu_malloc
            if self.precision.compute_dtype == torch.bfloat16 and self.world.rank == 0:
                warn_emulated_bf16()
        self.grad_accum_steps = grad_accum_steps
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.bucket_mb = float(bucket_mb)
        self.reduce_dtype = reduce_dtype
        if loss_scaler is not None and not self.precision.loss_scaling:
            raise ValueError(f"loss_scaler={loss_scaler!r} with precision={self.precision.name!r}: only "
                             "fp16 scales its loss; pass precision='fp16', or leave loss_scaler out")
        self.loss_scaler = (loss_scaler or LossScaler()) if self.precision.loss_scaling else None
        self.step_count = 0
        self._window = Window()
        n = self.world.world_size

        settings = {"strategy": self.strategy.name, "precision": self.precision.name,
                    "grad_accum_steps": grad_accum_steps,
                    "clip_grad_norm": self.clip_grad_norm, "bucket_mb": self.bucket_mb,
                    "reduce_dtype": str(reduce_dtype), "loss_scaler": repr(self.loss_scaler),
                    "param_groups": param_groups is not None, "zero3_units": zero3_units is not None,
                    "sync_batchnorm": sync_batchnorm, "broadcast_buffers": broadcast_buffers,
                    "batch_check_every": batch_check_every, "skip_nonfinite": skip_nonfinite,
                    "max_nonfinite_skips": max_nonfinite_skips}
        check_same_model_on_every_rank(model, self.world.rank, settings)
        named = unique_params(model)
        trainable = [(names[0], p) for names, p in named if p.requires_grad]
        groups = agreed("param_groups", lambda: None if param_groups is None else
                              group_by_overrides(trainable, param_groups))
        self._shard_params = self.strategy.shard_params and n > 1
        self.module = model
        # identical input batches on two ranks raise PlacementError (see engine/batch_check.py)
        self.batch_check = BatchCheck(every=batch_check_every, step_count=lambda: self.step_count)
        slot_of: dict[int, ParamSlot] = {}
        agreed("placing the model on its device",
                     lambda: place_model(model, named, slot_of, world=self.world, shard_params=self._shard_params))
        all_slots = [slot_of[id(p)] for _, p in named if id(p) in slot_of]
        self.slots = [s for s in all_slots if s.requires_grad]
        """The trainable parameters, one slot each (tied parameters share one)."""
        self._frozen_slots = [s for s in all_slots if not s.requires_grad]
        check_no_sync_batchnorm_on_cpu(model, self.world.device)
        self._batchnorms = convert_batchnorm(model) if sync_batchnorm else []
        self._buffer_sync = None
        if broadcast_buffers and n > 1:
            skip = {id(b) for m in self._batchnorms for b in m.buffers(recurse=False)}
            self._buffer_sync = BufferSync(model, skip=skip)

        self._zero3, self._zero3_guard = shard_parameters(
            model, all_slots, strategy=self.strategy, world=self.world, policy=zero3_units,
            in_backward=lambda: self._window.in_backward, window=lambda: self._window.index)
        self.optimizer = agreed("building the optimizer", lambda: build_optimizer(
            optimizer, self.slots, groups, module=model, strategy=self.strategy, rank=self.world.rank))
        check_same_optimizer_on_every_rank(self.optimizer, self.world.rank)
        if self.strategy.shard_optimizer and n > 1:
            check_elementwise(self.optimizer, strategy=self.strategy.name, after_step=False)
        sharded = self.strategy.shard_grads
        collective = _SHARDED_REDUCE.get(self.world.backend, "all_reduce") if sharded else "all_reduce"
        self._reducer = LocalReducer(self.slots, sharded=sharded) if n == 1 else GradReducer(
            self.slots, sharded=sharded, collective=collective, bucket_mb=self.bucket_mb,
            wire_dtype=reduce_dtype, rank=self.world.rank, num_ranks=n, device=self.world.device)
        self._update = Update(self.optimizer, self.slots, shard_grads=self.strategy.shard_grads,
                              loss_scaler=self.loss_scaler, clip_grad_norm=self.clip_grad_norm,
                              device=self.world.device, rank=self.world.rank, num_ranks=n,
                              defer_host_reads=defers_host_reads(self.world.device),
                              after_optimizer=self._gather_after_optimizer_step,
                              skip_nonfinite=skip_nonfinite, max_nonfinite_skips=max_nonfinite_skips)
        self._states = StateDicts(model, self.slots, self._frozen_slots, self.optimizer,
                                  strategy=self.strategy, precision=self.precision, loss_scaler=self.loss_scaler,
                                  zero3=self._zero3, guard=self._zero3_guard, world=self.world)
        self._backward_pass = BackwardPass(
            slots=self.slots, frozen_params=[(names[0], p) for names, p in named if not p.requires_grad],
            window=self._window, reducer=self._reducer, zero3=self._zero3, loss_scaler=self.loss_scaler,
            grad_accum_steps=grad_accum_steps, shard_grads=self.strategy.shard_grads, world=self.world,
            step_count=lambda: self.step_count)
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._backward_pass.grad_ready_hook(s))
                       for s in self.slots]
        if self.strategy.shard_optimizer and n > 1:  # see [Note: a rank's optimizer state dict]
            self._hooks.extend(guard_sharded_optimizer(self.optimizer, rank=self.world.rank, world_size=n,
                                                       strategy=self.strategy.name))
        self._inputs = InputRecorder(  # see [Note: forward inputs]
            model, readers=[self._count_rows, self.batch_check.record],
            in_backward=lambda: self._window.in_backward,
            before_training_forward=None if self._buffer_sync is None else self._buffer_sync.before_forward)
        trace = None if trace_dir is None else TraceSession(
            trace_dir, rank=self.world.rank, warmup=trace_steps[0], active=trace_steps[1],
            device=self.world.device)
        self._observer = StepObserver(self.world.device, rank=self.world.rank, trace=trace)

    # -- forward / backward ----------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.world.device.type, dtype=self.precision.compute_dtype)

    def _count_rows(self, inputs: ForwardInputs, args: Any, kwargs: Any) -> None:
        self._window.forwards += 1
        rows = inputs.rows
        if rows is not None:
            self._window.batch_size = (self._window.batch_size or 0) + rows

    @observed("forward")
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward under the engine's precision: ``torch.autocast`` to bf16/fp16 for
        ``precision="bf16"``/``"fp16"`` (the parameters stay fp32). ``engine.module(x)`` runs the same
        module without autocast, in the parameters' dtype; under zero3 either gathers each unit, so
        every rank must make the same calls (see docs/engine.md).

        Example::

            logits = engine(tokens)            # bf16 matmuls under precision="bf16"
        """
        try:
            with self._autocast(), self._saving_parameters():
                return self.module(*args, **kwargs)
        except RuntimeError as exc:
            if self._zero3 is None:
                raise
            explained = self._zero3.after_failed_forward(exc)
            if explained is None:
                raise
            raise explained from exc

    def _saving_parameters(self) -> contextlib.AbstractContextManager[Any]:
        if self._zero3 is None or not torch.is_grad_enabled():
            return contextlib.nullcontext()
        return self._zero3.saving_parameters_by_reference()

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
        w = self._backward_pass.check(loss, weight)
        # Refused above with nothing changed: the window goes on, and so does its step breakdown.
        self._backward(loss, w)

    @observed("backward")
    def _backward(self, loss: torch.Tensor, w: float | None) -> None:
        self.batch_check.before_backward()  # raises on every rank, before any state changes
        self._backward_pass.run(loss, w)

    # -- mode, like nn.Module -------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """Whether the module is in training mode (``engine.module.training``)."""
        return self.module.training

    def train(self, mode: bool = True) -> Engine:
        """Put the module in training mode (``mode=False``: evaluation) and return the engine, as
        ``nn.Module.train`` does. Dropout and BatchNorm follow the mode; the buffer broadcast before
        each forward runs in training mode only.

        Example::

            engine.eval()
            with torch.no_grad():
                val_loss = loss_fn(engine(x), y)
            engine.train()
        """
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """``engine.train(False)``: evaluation mode, returning the engine."""
        return self.train(False)

    # -- optimizer step --------------------------------------------------------------------------
    @observed("optimizer")
    def step(self) -> bool:
        """Apply the optimizer to the window's averaged gradients (after 1 to ``grad_accum_steps``
        ``backward()`` calls; a shorter window, e.g. at the end of an epoch, is reduced here). Returns
        False when the step was skipped on every rank, parameters and optimizer state untouched: an
        fp16 overflow (the loss scale lowered); in fp32 and bf16 with ``skip_nonfinite=True``, a
        global gradient norm (when clipping measures it) or a loss of the window that was not
        finite on some rank; or ``weight=0`` on every rank. ``max_nonfinite_skips`` such skips in a row raise ``FloatingPointError`` (see [Note:
        non-finite steps] in :mod:`dspark.engine.update`)."""
        if self._window.micro_step == 0:
            raise RuntimeError(f"rank {self.world.rank}: step() before backward(); call "
                               "engine.backward(loss) first")
        try:
            if not self._window.synced:
                self._backward_pass.sync()
            applied = self._apply_update()
            self._reducer.after_step()
            return applied
        finally:
            self._backward_pass.end_window()

    def _apply_update(self) -> bool:
        if not self._window.has_grads:
            log.warning("rank %d: every rank gave weight=0: nothing to average, step skipped",
                        self.world.rank)
            return False
        applied = self._update.apply(nonfinite_loss=self._reducer.nonfinite_loss)
        if applied:
            self.step_count += 1
        return applied

    def _gather_after_optimizer_step(self) -> None:
        """zero1/zero2: check the sharded optimizer's state once, and all-gather the updated rows."""
        if self.step_count == 0 and self.strategy.shard_optimizer and self.world.world_size > 1:
            agreed("checking the optimizer's state after its first step",  # one small gather, once
                         lambda: check_elementwise(self.optimizer, strategy=self.strategy.name, after_step=True))
        if self.strategy.shard_optimizer and not self._shard_params:
            self._reducer.gather_updated_rows()

    @property
    def nonfinite_steps(self) -> int:
        """Steps skipped so far because the global gradient norm was not finite (fp16 overflows
        included)."""
        return self._update.nonfinite_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last step that measured it: with
        ``clip_grad_norm=``, under fp16, or through :meth:`clip_grad_norm_`; inf or nan when a
        gradient held one. None before any such step."""
        return self._update.last_grad_norm

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
        if not self._window.synced:
            raise RuntimeError(
                f"rank {self.world.rank}: clip_grad_norm_() before the window's gradients are reduced "
                f"({self._window.micro_step} of grad_accum_steps={self.grad_accum_steps} backward() calls "
                "so far); call it after the window's last engine.backward() and before engine.step()")
        return self._update.clip(max_norm)

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
        return self.strategy.placements([s.name for s in self.slots])

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
        self._check_in_step("full_state_dict")
        self.sync_buffers()
        return self._states.full(rank0_only=rank0_only, cpu=cpu)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor] | None, src_rank: int | None = 0, *,
                             strict: bool = True) -> IncompatibleKeys:
        """Load a plain ``model.state_dict()`` (pretrained weights) held by rank ``src_rank`` only into
        the engine, whatever its strategy; the other ranks pass None (or anything: it is not read).
        It is checked there first, then sent one tensor at a time, each rank keeping what its strategy
        holds (zero3: its rows), so no rank but the source ever holds the whole model (see [Note:
        pretrained weights without N copies] in :mod:`dspark.engine.pretrained`). ``src_rank=None``:
        every rank passes the same state dict and nothing is sent. Optimizer state is untouched.
        Missing, unexpected and mis-shaped keys are a ``ValueError`` listing them on every rank;
        ``strict=False`` loads what matches and logs the rest. Returns the missing and unexpected keys,
        as ``nn.Module.load_state_dict`` does. Collective.

        Example::

            sd = torch.load("gpt2.pt", weights_only=True) if dspark.get_world().is_main else None
            engine.load_full_state_dict(sd, src_rank=0)
            missing, unexpected = engine.load_full_state_dict(backbone, strict=False)  # a new head
        """
        self._check_between_steps("load_full_state_dict")
        return IncompatibleKeys(*load_from_rank(self._states.weight_entries(), state_dict, src_rank=src_rank,
                                                strict=strict, device=self.world.device))

    def load_pretrained(self, path: str | os.PathLike[str], key_map: KeyMap | None = None,
                        strict: bool = True) -> IncompatibleKeys:
        """Load pretrained weights from a ``.safetensors`` file or a HuggingFace model directory
        (``model.safetensors``, or shards + ``model.safetensors.index.json``): every rank reads only
        what its strategy holds (zero3: its rows, through safetensors slices), so no rank ever holds
        the whole model. ``key_map`` renames the file's keys to the model's (a dict, or a function
        returning the name or None to skip the key); a tied parameter loads from whichever of its
        names the file holds. Missing, unexpected and mis-shaped keys are a ``ValueError`` listing
        them (``strict=False``: a warning, and the rest loads). Returns the missing and unexpected
        keys. Collective.

        Example::

            with dspark.meta_init():
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("gpt2"))
            engine = dspark.Engine(model, optimizer=opt, strategy="zero3")
            engine.load_pretrained("/models/gpt2")        # config.json + model.safetensors
        """
        self._check_between_steps("load_pretrained")
        return IncompatibleKeys(*load_pretrained(self._states.weight_entries(), path, key_map=key_map,
                                                 strict=strict))

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB") -> Path:
        """Write the model's weights as HuggingFace does: safetensors shards of at most
        ``max_shard_size`` (``"5GB"``, ``"500MB"`` or bytes) + ``model.safetensors.index.json`` (one
        ``model.safetensors`` when it fits), names as in ``model.state_dict()``, a tied parameter
        once; the model's ``config`` beside them when it has ``save_pretrained`` (a HuggingFace
        model), so ``AutoModelForCausalLM.from_pretrained(directory)`` loads it. zero3 gathers one
        unit at a time and rank 0 writes each shard as soon as it is complete: no rank holds the whole
        model. Collective; returns the directory.

        Example::

            engine.save_pretrained("out/gpt2-finetuned")
            model = transformers.AutoModelForCausalLM.from_pretrained("out/gpt2-finetuned")
        """
        self._check_between_steps("save_pretrained")
        self.sync_buffers()
        zero3 = self._zero3
        return save_pretrained(self._states.weight_entries(), directory, max_shard_size=max_shard_size,
                               units=[unit.slots for unit in zero3.units] if zero3 is not None else [],
                               gather=functools.partial(zero3.gather_slots, purpose="save_pretrained")
                               if zero3 is not None else _nothing,
                               free=zero3.free_slots if zero3 is not None else _nothing,
                               config=getattr(self.module, "config", None))

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
        self._check_in_step("sharded_state_dict")
        return self._states.sharded(step_count=self.step_count)

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install a structure like :meth:`sharded_state_dict`'s (each tensor this rank's rows or the
        whole tensor), whatever world size and strategy wrote it.

        Example::

            sd = engine.sharded_state_dict()
            dcp.load(sd, checkpoint_id="ckpt/dcp")
            engine.load_sharded_state_dict(sd)
        """
        self._check_between_steps("load_sharded_state_dict")
        step_count = self._states.load_sharded(state)
        if step_count is not None:
            self.step_count = step_count

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

    def load(self, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None,
             optimizer: bool = True) -> CheckpointInfo:
        """Load the checkpoint at ``path``, whatever world size and strategy wrote it: parameters,
        buffers, optimizer state (also before the first step), hyper-parameters, step count, fp16
        loss scale, this rank's random state, and each ``extra`` object's state (in place, with its
        ``load_state_dict``). ``optimizer=False`` loads the weights and buffers only (and ``extra``),
        into an engine with any optimizer: the checkpoint's optimizer state is not read. Collective:
        call it on every rank, between steps. Returns what the checkpoint's ``dspark.json`` says
        (step, strategy, world size, versions).

        Example::

            info = engine.load("ckpt/latest", extra={"scheduler": sched, "loader": loader})
            eval_engine.load("ckpt/latest", optimizer=False)   # weights only
        """
        self._check_between_steps("load")
        from dspark.checkpoint import load_checkpoint

        return load_checkpoint(self, path, extra=extra, optimizer=optimizer)

    def _check_in_step(self, call: str) -> None:
        """Collective: raise on every rank unless every rank is at the same point of training as it
        enters ``engine.<call>()`` (see [Note: ranks in step] in :mod:`dspark.engine.window`)."""
        if self.world.world_size == 1:
            return
        mine = torch.tensor(StepTag.of(self._window, self.step_count).values(), dtype=torch.int64,
                            device=self.world.device)
        everyone = comm.all_gather(mine, label=f"dspark.{call}.step_check")
        check_in_step([StepTag(*map(int, t.tolist())) for t in everyone], rank=self.world.rank,
                      what=f"engine.{call}()")

    def _check_between_steps(self, what: str) -> None:
        self._check_in_step(what)  # first: a refusal on one rank alone would strand the others
        if self._window.micro_step != 0:
            raise RuntimeError(f"rank {self.world.rank}: {what}() after {self._window.micro_step} of "
                               f"grad_accum_steps={self.grad_accum_steps} backward() calls; call it "
                               "between steps (after engine.step())")

    def memory_report(self) -> dict[str, int | str]:
        """Bytes this rank holds for parameters (trainable and frozen), gradients (as held at the end
        of the last backward) and optimizer state, measured from the tensors, next to what the
        strategy should hold. Frozen parameters count in ``params_bytes`` only: they have no gradient
        and no optimizer state (zero3 shards them too)."""
        # frozen parameters have slots only where zero3 shards them; elsewhere they stay as built
        frozen: list[tuple[torch.Size, torch.dtype, torch.Tensor]] = (
            [(s.shape, s.dtype, s.padded_shard if s.padded_shard is not None else s.param)
             for s in self._frozen_slots] if self._shard_params else
            [(p.shape, p.dtype, p) for _, p in unique_params(self.module) if not p.requires_grad])
        return memory_report(policy=self.strategy, slots=self.slots, frozen=frozen, optimizer=self.optimizer,
                             grads_bytes=self._window.grads_bytes_held,
                             comm_buffer_bytes=self._reducer.comm_buffer_bytes(),
                             rank=self.world.rank, num_ranks=self.world.world_size)

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
                          buckets=self._reducer.buckets,
                          optimizer=self.optimizer, batch=self._inputs.last, rank=self.world.rank,
                          num_ranks=self.world.world_size, device=self.world.device)

    def close(self) -> None:
        """Remove the engine's hooks (the module keeps working as a plain module unless zero3) and stop
        its trace, if one is still recording."""
        self._observer.close()
        self._inputs.remove()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._zero3 is not None:
            self._zero3.remove_hooks()
        if self._zero3_guard is not None:
            self._zero3_guard.remove()
        restore_batchnorm(self._batchnorms)
        self._batchnorms = []


def _nothing(slots: list[ParamSlot]) -> None:
    """What gathers and frees parameters where nothing is sharded."""


def defers_host_reads(device: torch.device) -> bool:
    """Whether the step reads the gradient norm only after queueing the optimizer (see [Note: the
    step's one host read] in :mod:`dspark.engine.host_read`): on a GPU. A CPU has no queue to keep
    full, and there the clip's skip when the norm is below ``max_norm`` saves a pass over the
    gradients. (The tests switch it on for CPU ranks, to run the GPU's order of work there.)"""
    return device.type == "cuda"

