"""``Engine``: data-parallel training of one model on every rank, with the ZeRO stage as policy
(:mod:`~dspark.policy.strategies`: one code path serves every strategy). This file holds the public API;
:func:`~dspark.engine.build.build_parts` builds the parts it drives: the forward's inputs
(:mod:`~dspark.engine.inputs`), zero3's gathers (:mod:`~dspark.engine.zero3_units`), backward over the
accumulation window (:mod:`~dspark.engine.backward`, :mod:`~dspark.engine.window`), gradients reduced
in buckets (:mod:`~dspark.engine.grad_reducer`), the update (:mod:`~dspark.engine.update`) and the
state dicts (:mod:`~dspark.engine.state_dict`). The map of every module: docs/engine.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from dspark import comm, cpu_malloc
from dspark.engine.audit import audit_rows
from dspark.engine.auto_strategy import strategy_and_plan
from dspark.engine.buffer_sync import broadcast_tensors
from dspark.engine.build import EngineParts, OptimizerFactory, build_parts
from dspark.engine.config import EngineConfig, loss_scaler_for, spells_out_options
from dspark.engine.host_read import defers_host_reads
from dspark.engine.memory_report import frozen_held, memory_report
from dspark.engine.not_a_module import NotTheModule
from dspark.engine.pretrained import load_from_rank, load_pretrained
from dspark.engine.state_dict import IncompatibleKeys
from dspark.engine.step_observer import observed
from dspark.engine.trace import check_no_outer_profiler
from dspark.engine.validation import check_max_norm, check_model_and_optimizer, warn_emulated_bf16
from dspark.engine.weights import KeyMap
from dspark.engine.window import Window, check_between_steps, check_ranks_in_step
from dspark.planner import Plan
from dspark.policy.strategies import precision_policy, sharding_policy
from dspark.tensor import DistTensor, Placement
from dspark.tensor.batch import split_batch

if TYPE_CHECKING:
    from dspark.checkpoint import CheckpointInfo

__all__ = ["Engine", "IncompatibleKeys", "engine_parts"]

log = logging.getLogger(__name__)
B = TypeVar("B")

class Engine(NotTheModule):
    """Wrap ``model`` for data-parallel training on every rank of the world.

    Example::

        engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                               strategy="zero2", precision="bf16")
        for inputs, targets in batches:
            x, y = dspark.distribute_batch((inputs, targets), shard_dim=0)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()

    Every rank builds the same model (checked, then rank 0's parameters and buffers broadcast), on a
    device or on meta (``dspark.meta_init()`` replays its own initialisation). Up to
    ``grad_accum_steps`` ``backward(loss)`` calls, then ``step()``: the mean over the window's
    micro-batches and all ranks, communicated during the last backward: pass each micro-batch's mean
    loss, never divided by ``grad_accum_steps`` (a loss whose graph ends in that division is refused;
    ``allow_accum_scaled_loss=True`` for one meant to be scaled so). ``strategy="auto"`` picks
    the fastest strategy (with ``sample_batch``, and micro-batch) that fits ``memory_budget``
    (``engine.plan``). Identical input batches on two ranks raise :class:`dspark.PlacementError`.
    The options are :class:`dspark.EngineConfig`'s, by keyword or as ``config=`` (keyword options
    apply on top of it). Every option, what runs under the precision and the checks that keep
    ranks in step: docs/engine.md.
    """

    @spells_out_options  # inspect.signature(Engine) and help() list every option of EngineConfig
    def __init__(self, model: nn.Module, *, optimizer: OptimizerFactory, config: EngineConfig | None = None,
                 sample_batch: Any = None, loss_fn: Callable[..., torch.Tensor] | None = None, **options: Any) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a dspark.EngineConfig, got {type(config).__name__}")
        # keyword options apply on top of config (see [Note: options declared once])
        self.config = config = (config or EngineConfig()).replace(**options)
        """The options this engine was built with, as given (``strategy="auto"`` stays ``"auto"``:
        :attr:`strategy` and :attr:`grad_accum_steps` say what it chose)."""
        check_model_and_optimizer(model, optimizer)
        check_no_outer_profiler(config.observation.trace_dir)
        self.world = comm.get_world()
        if self.world.device.type == "cpu":  # before auto's probe and the first step allocate: see dspark.cpu_malloc
            cpu_malloc.tune_for_training()
        choice = strategy_and_plan(config, model=model, optimizer=optimizer, world=self.world,
                                   sample_batch=sample_batch, loss_fn=loss_fn)
        self.plan: Plan | None = choice.plan
        """``strategy="auto"``: the :class:`dspark.planner.Plan` it chose from; else None."""
        self.micro_batch = choice.micro_batch
        """Rows per forward auto planned from ``sample_batch`` (:meth:`micro_batches`); else None."""
        self.grad_accum_steps: int = choice.grad_accum_steps or config.grad_accum_steps or 1
        self.strategy = sharding_policy(choice.strategy)
        self.precision = precision_policy(config.precision)
        if self.world.device.type == "cpu" and self.precision.compute_dtype == torch.bfloat16 and self.world.rank == 0:
            warn_emulated_bf16()
        self.loss_scaler = loss_scaler_for(config)
        self.step_count = 0
        self._window = Window()
        parts = build_parts(
            model, optimizer, config=config, world=self.world, strategy=self.strategy,
            grad_accum_steps=self.grad_accum_steps, window=self._window, loss_scaler=self.loss_scaler,
            step_count=lambda: self.step_count, defer_host_reads=defers_host_reads(self.world.device),
            planned_micro_batch=self.micro_batch)
        self.module = model
        self.slots = parts.slots
        """The trainable parameters, one slot each (tied parameters share one)."""
        self.optimizer = parts.optimizer
        self.batch_check = parts.batch_check
        """Compares the ranks' input batches (identical ones raise :class:`dspark.PlacementError`)."""
        self._parts = parts  # the parts a step runs: engine_parts(engine) for tests and benchmarks

    # -- forward / backward ----------------------------------------------------------------------
    @observed("forward", lambda engine: engine._parts.observer)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward under the engine's precision: ``torch.autocast`` to bf16/fp16 for
        ``precision="bf16"``/``"fp16"`` (the parameters stay fp32); ``engine.module(x)`` runs without
        autocast. Under zero3 either gathers each unit: every rank makes the same calls.

        Example::

            logits = engine(tokens)            # bf16 matmuls under precision="bf16"
        """
        zero3 = self._parts.zero3
        saving = (contextlib.nullcontext() if zero3 is None or not torch.is_grad_enabled()
                  else zero3.saving_parameters_by_reference())
        try:
            with self.precision.autocast(self.world.device.type), saving:
                return self.module(*args, **kwargs)
        except RuntimeError as exc:
            explained = None if zero3 is None else zero3.after_failed_forward(exc)
            if explained is None:
                raise
            raise explained from exc

    def micro_batches(self, batch: B) -> list[B]:
        """This rank's ``batch`` for one step in ``grad_accum_steps`` equal parts along dim 0.

        Example::

            for x, y in engine.micro_batches(batch):   # e.g. the micro-batch strategy="auto" chose
                engine.backward(loss_fn(engine(x), y))
        """
        return split_batch(batch, self.grad_accum_steps)

    def backward(self, loss: torch.Tensor, *, weight: float | int | torch.Tensor | None = None) -> None:
        """Backpropagate ``loss`` (the mean loss of this rank's micro-batch). The update averages the
        window's micro-batches over all ranks with equal weights; with ``weight=n`` (the samples or
        tokens this rank's loss averages over) it is the mean over all of them, as one process
        computes it (``weight=0``: nothing from this rank). Gradients are reduced during the window's
        last backward.

        Example::

            engine.backward(loss, weight=int((labels != -100).sum()))
        """
        w = self._parts.backward_pass.check(loss, weight)
        # Refused above with nothing changed: the window goes on, and so does its step breakdown.
        self._backward(loss, w)

    @observed("backward", lambda engine: engine._parts.observer)
    def _backward(self, loss: torch.Tensor, w: float | None) -> None:
        self.batch_check.before_backward()  # raises on every rank, before any state changes
        self._parts.backward_pass.run(loss, w)

    # -- mode, like nn.Module -------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """Whether the module is in training mode (``engine.module.training``)."""
        return self.module.training

    def train(self, mode: bool = True) -> Engine:
        """Put the module in training mode (``mode=False``: evaluation) and return the engine, as
        ``nn.Module.train`` does; the buffer broadcast before each forward runs in training mode only.

        Example::

            engine.eval(); val_loss = loss_fn(engine(x), y); engine.train()
        """
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """``engine.train(False)``: evaluation mode, returning the engine."""
        return self.train(False)

    # -- optimizer step --------------------------------------------------------------------------
    @observed("optimizer", lambda engine: engine._parts.observer)
    def step(self) -> bool:
        """Apply the optimizer to the window's averaged gradients (after 1 to ``grad_accum_steps``
        ``backward()`` calls). False when the step was skipped on every rank, nothing changed: an
        fp16 overflow, a non-finite loss or norm (``skip_nonfinite``), or ``weight=0`` everywhere;
        see [Note: non-finite steps] in :mod:`dspark.engine.update`.

        Example::

            if not engine.step(): log.warning("step skipped")
        """
        if self._window.micro_step == 0:
            raise RuntimeError(f"rank {self.world.rank}: step() before backward(); call engine.backward(loss) first")
        try:
            if not self._window.synced:
                self._parts.backward_pass.sync()
            applied = self._apply_update()
            self._parts.reducer.after_step()
            return applied
        finally:
            self._parts.backward_pass.end_window()

    def _apply_update(self) -> bool:
        if not self._window.has_grads:
            log.warning("rank %d: every rank gave weight=0: nothing to average, step skipped", self.world.rank)
            return False
        reducer = self._parts.reducer
        applied = self._parts.update.apply(nonfinite_loss=reducer.nonfinite_loss, found_inf=reducer.found_inf)
        if applied:
            self.step_count += 1
        return applied

    @property
    def nonfinite_steps(self) -> int:
        """Steps skipped so far because a loss or a reduced gradient was not finite (fp16 overflows
        included)."""
        return self._parts.update.nonfinite_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last step that measured it: with
        ``clip_grad_norm=`` or through :meth:`clip_grad_norm_`; inf or nan when a gradient held one.
        None before any such step."""
        return self._parts.update.last_grad_norm

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the window's reduced gradients to a global L2 norm of at most ``max_norm`` and
        return the norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` in one process
        (``max_norm=float("inf")`` only measures it); under zero2/zero3 the model's parameters hold no
        gradient, so PyTorch's own function would see none. Collective; after the window's last
        ``backward()``. ``clip_grad_norm=`` does the same inside ``step()``.

        Example::

            engine.backward(loss)
            norm = engine.clip_grad_norm_(1.0)
            engine.step()
        """
        check_max_norm(max_norm)
        if not self._window.synced:
            raise RuntimeError(
                f"rank {self.world.rank}: clip_grad_norm_() before the window's gradients are reduced "
                f"({self._window.micro_step} of grad_accum_steps={self.grad_accum_steps} backward() calls "
                "so far); call it after the window's last engine.backward() and before engine.step()")
        return self._parts.update.clip(max_norm)

    # -- state -----------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None unless precision is fp16)."""
        return None if self.loss_scaler is None else self.loss_scaler.scale

    def placements(self) -> dict[str, dict[str, Placement]]:
        """How this engine lays out each trainable parameter, its gradient and its optimizer state
        across ranks: ``{"params" | "grads" | "optimizer_state": {name: Shard(dim=0) | Replicate()}}``;
        nothing is replicated unless the strategy says so.

        Example::

            engine.placements()["grads"]["fc.weight"]   # Shard(dim=0) under zero2
        """
        return self.strategy.placements([s.name for s in self.slots])

    def sharded_parameters(self) -> dict[str, DistTensor]:
        """This rank's rows of every trainable parameter as a ``Shard(0)`` :class:`DistTensor` (the
        tensors the optimizer updates); raises under ``replicate``, which shards nothing."""
        if not self.strategy.shard_optimizer or self._parts.rank_groups.replica is not None:
            raise ValueError(f"strategy={self.strategy.name!r} shards nothing over the world; "
                             "sharded_parameters() needs zero1, zero2 or zero3 (a hybrid strategy's "
                             "rows: engine.sharded_state_dict(), DTensors on its 2-D mesh)")
        return {s.name: s.dist_shard() for s in self.slots}

    def full_state_dict(self, *, rank0_only: bool = False, cpu: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers (rank 0's), named as in ``model.state_dict()``.
        Collective. zero3 gathers one unit at a time (peak: the result plus one unit).
        ``rank0_only=True``: the result on rank 0, ``{}`` elsewhere; ``cpu=True``: in CPU memory.

        Example::

            sd = engine.full_state_dict(rank0_only=True, cpu=True)
            if dspark.get_world().is_main:
                torch.save(sd, "model.pt")
        """
        self._check_in_step("full_state_dict")
        self.sync_buffers()
        return self._parts.states.full(rank0_only=rank0_only, cpu=cpu)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor] | None, src_rank: int | None = 0, *,
                             strict: bool = True) -> IncompatibleKeys:
        """Load a plain ``model.state_dict()`` held by rank ``src_rank`` (the others pass None; with
        ``src_rank=None`` every rank passes it), whatever the strategy: sent one tensor at a time, each
        rank keeping what its strategy holds ([Note: pretrained weights without N copies] in
        :mod:`dspark.engine.pretrained`). Missing, unexpected and mis-shaped keys are a ``ValueError``
        on every rank (``strict=False``: logged). Returns them. Collective; optimizer state untouched.

        Example::

            sd = torch.load("gpt2.pt", weights_only=True) if dspark.get_world().is_main else None
            engine.load_full_state_dict(sd, src_rank=0)
            missing, unexpected = engine.load_full_state_dict(backbone, strict=False)  # a new head
        """
        self._check_between_steps("load_full_state_dict")
        return IncompatibleKeys(*load_from_rank(*self._parts.states.load_targets(), state_dict, src_rank=src_rank,
                                                strict=strict, device=self.world.device))

    def load_pretrained(self, path: str | os.PathLike[str], key_map: KeyMap | None = None,
                        strict: bool = True) -> IncompatibleKeys:
        """Load weights from a ``.safetensors`` file or a HuggingFace model directory (one file, or
        shards + index); every rank reads only what its strategy holds. ``key_map`` renames the file's
        keys (a dict, or a function returning the name or None to skip). Missing, unexpected and
        mis-shaped keys are a ``ValueError`` (``strict=False``: a warning). Returns them. Collective.
        A peft model takes its base model's file as it is (the adapter keeps its initialisation).

        Example::

            with dspark.meta_init():
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("gpt2"))
            engine = dspark.Engine(model, optimizer=opt, strategy="zero3")
            engine.load_pretrained("/models/gpt2")        # config.json + model.safetensors
        """
        self._check_between_steps("load_pretrained")
        return IncompatibleKeys(*load_pretrained(*self._parts.states.load_targets(), path, key_map=key_map,
                                                 strict=strict))

    def save_pretrained(self, directory: str | os.PathLike[str], max_shard_size: int | str = "5GB", *,
                        merged: bool = False) -> Path:
        """Write the weights as HuggingFace does: safetensors shards of at most ``max_shard_size``
        (``"5GB"``, ``"500MB"`` or bytes) + index, names as in ``model.state_dict()``, a tied parameter
        once, and the model's ``config``; zero3 gathers one unit at a time and rank 0 writes each shard
        when complete. A peft model: its adapter as peft saves it (``merged=True``: the merged model).
        Collective; returns the directory.

        Example::

            engine.save_pretrained("out/gpt2-finetuned")
            model = transformers.AutoModelForCausalLM.from_pretrained("out/gpt2-finetuned")
        """
        self._check_between_steps("save_pretrained")
        self.sync_buffers()
        return self._parts.states.save_pretrained(directory, max_shard_size=max_shard_size,
                                                  config=getattr(self.module, "config", None), merged=merged)

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers now (collective; done before checkpoints and full state
        dicts, so that they never depend on which rank is asked)."""
        if self.world.world_size > 1:
            broadcast_tensors(list(self.module.buffers()))

    def sharded_state_dict(self) -> dict[str, Any]:
        """Everything the engine holds as PyTorch's distributed checkpoint consumes it: live tensors,
        this rank's rows as ``Shard(0)`` DTensors ([Note: sharded state dict] in
        :mod:`dspark.engine.state_dict`). ``engine.save`` is built on it.

        Example::

            dcp.save(engine.sharded_state_dict(), checkpoint_id="ckpt/dcp")   # torch.distributed.checkpoint
        """
        self._check_in_step("sharded_state_dict")
        return self._parts.states.sharded(step_count=self.step_count)

    def empty_shard(self, global_rows: Sequence[int], dtype: torch.dtype) -> Any:
        """An empty tensor for this rank's rows of a tensor sharded as the optimizer state is (a
        DTensor, as :meth:`sharded_state_dict` gives it); None when this rank holds no rows. A
        checkpoint load reads optimizer state into these."""
        return self._parts.states.empty_shard(global_rows, dtype)

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install a structure like :meth:`sharded_state_dict`'s (each tensor this rank's rows or the
        whole tensor), whatever world size and strategy wrote it.

        Example::

            sd = engine.sharded_state_dict()
            dcp.load(sd, checkpoint_id="ckpt/dcp")
            engine.load_sharded_state_dict(sd)
        """
        self._check_between_steps("load_sharded_state_dict")
        step_count = self._parts.states.load_sharded(state)
        if step_count is not None:
            self.step_count = step_count

    def save(self, path: str | os.PathLike[str], *, async_save: bool = False,
             extra: Mapping[str, Any] | None = None) -> Path:
        """Save a sharded checkpoint directory at ``path`` (:mod:`dspark.checkpoint`): each rank's
        shards of parameters and optimizer state, the step count, hyper-parameters, fp16 loss scale,
        every rank's random state, each ``extra`` object's ``state_dict()`` (an LR scheduler, a
        ``dspark.DataLoader``), and the model's HuggingFace config (``config.json``) if it has one. A
        checkpoint already at ``path`` is replaced once the new one is complete. ``async_save=True``
        returns once the state is in CPU memory and writes it in the background (the next save,
        ``load`` and ``dspark.shutdown()`` wait for it). Collective, between steps.

        Example::

            engine.save("ckpt/latest")
            engine.save("ckpt/step-100", async_save=True)   # training goes on while it is written
        """
        # imported here: DCP is heavy to import and most runs never checkpoint
        from dspark.checkpoint import save_checkpoint
        from dspark.checkpoint.timeouts import naming_the_checkpoint

        with naming_the_checkpoint("save", path, step_count=self.step_count, rank=self.world.rank,
                                   num_ranks=self.world.world_size):
            self._check_between_steps("save")
            return save_checkpoint(self, path, async_save=async_save, extra=extra,
                                   model_config=self._parts.states.hf_config())

    def load(self, path: str | os.PathLike[str], *, extra: Mapping[str, Any] | None = None,
             optimizer: bool = True, verify: bool = True) -> CheckpointInfo:
        """Load the checkpoint at ``path``, whatever world size and strategy wrote it: parameters,
        buffers, optimizer state, hyper-parameters, step count, fp16 loss scale, this rank's random
        state and each ``extra`` object's state (``load_state_dict``). ``optimizer=False`` loads the
        weights and buffers only, into an engine with any optimizer. ``verify=False`` loads a
        checkpoint without ``manifest.json``, unchecked (refused otherwise). Collective, between
        steps. Returns what the checkpoint's ``dspark.json`` says (step, strategy, world size, versions).

        Example::

            info = engine.load("ckpt/latest", extra={"scheduler": sched, "loader": loader})
            eval_engine.load("ckpt/latest", optimizer=False)   # weights only
        """
        from dspark.checkpoint import load_checkpoint
        from dspark.checkpoint.timeouts import naming_the_checkpoint

        with naming_the_checkpoint("load", path, step_count=self.step_count, rank=self.world.rank,
                                   num_ranks=self.world.world_size):
            self._check_between_steps("load")
            return load_checkpoint(self, path, extra=extra, optimizer=optimizer, verify=verify)

    def _check_in_step(self, call: str) -> None:
        check_ranks_in_step(self._window, self.step_count, world=self.world, call=call)

    def _check_between_steps(self, what: str) -> None:
        check_between_steps(self._window, self.step_count, world=self.world, call=what,
                            grad_accum_steps=self.grad_accum_steps)

    def memory_report(self) -> dict[str, int | str]:
        """Bytes this rank holds for parameters (trainable and frozen), gradients (as held at the end
        of the last backward) and optimizer state, measured from the tensors, next to what the
        strategy should hold. Frozen parameters count in ``params_bytes`` only: they have no gradient
        and no optimizer state (zero3 shards them too)."""
        frozen = frozen_held(self._parts.frozen_slots, self.module, shard_params=self._parts.shard_params)
        return memory_report(policy=self.strategy, slots=self.slots, frozen=frozen, optimizer=self.optimizer,
                             grads_bytes=self._window.grads_bytes_held,
                             comm_buffer_bytes=self._parts.reducer.comm_buffer_bytes(),
                             rank=self.world.rank, num_ranks=self.world.world_size,
                             shard_rank=self._parts.rank_groups.shard_rank,
                             shard_group_size=self._parts.rank_groups.shard_size)

    def step_stats(self) -> dict[str, float]:
        """Where this rank's last step went, in milliseconds: ``step_ms``, ``forward_ms``,
        ``backward_ms``, ``comm_exposed_ms`` (communication compute did not hide), ``optimizer_ms``,
        ``data_ms`` and ``compute_ms`` (to compare across ranks for a straggler); [Note: step
        breakdown] in :mod:`dspark.engine.step_observer`. On CUDA it synchronises with the last step.

        Example::

            stats = engine.step_stats()   # {"step_ms": 41.8, "forward_ms": 12.1, ...}
        """
        return self._parts.observer.step_stats()

    def audit(self) -> list[dict[str, Any]]:
        """Every tensor this rank holds (parameters, gradients, optimizer state, the last input batch)
        with its placement, ``bytes`` held, ``expected_bytes`` its placement needs and ``factor``
        between them; see [Note: replication audit] in :mod:`dspark.engine.audit`. Collective: call it
        on every rank.

        Example::

            from dspark.engine.audit import format_audit
            print(format_audit(engine.audit()))  # input batch: 2.0x a 1/2 share, replicated on every rank
        """
        parts = self._parts
        return audit_rows(module=self.module, slots=(*self.slots, *parts.frozen_slots), strategy=self.strategy,
                          params_sharded=parts.shard_params, buckets=parts.reducer.buckets,
                          optimizer=self.optimizer, batch=parts.inputs.last, rank=self.world.rank,
                          num_ranks=self.world.world_size, device=self.world.device,
                          shard_rank=parts.rank_groups.shard_rank, shard_group_size=parts.rank_groups.shard_size)

    def close(self) -> None:
        """Remove the engine's hooks (the module keeps working as a plain module unless zero3) and stop
        its trace, if one is still recording."""
        self._parts.close()


def engine_parts(engine: Engine) -> EngineParts:
    """The parts ``engine`` drives (its zero3 scheduler, reducer, update, state dicts, step
    observer...), for DSpark's own tests and benchmarks that look inside a step. Not the user API:
    the parts change as the engine does.

    Example::

        scheduler = engine_parts(engine).zero3   # None unless strategy="zero3"
    """
    return engine._parts
