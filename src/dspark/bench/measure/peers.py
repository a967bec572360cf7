"""PyTorch's own data-parallel wrappers (and, with the optional ``peers`` extra, DeepSpeed's ZeRO
stages: :mod:`dspark.bench.measure.deepspeed_peer`), measured by the same worker as DSpark's engine, so a
claim like "DSpark's zero3 is as fast as FSDP2" is a measurement side by side, not a belief.

=============  ===================================================  ===================
peer           PyTorch tool                                         DSpark counterpart
=============  ===================================================  ===================
``torch-ddp``  ``torch.nn.parallel.DistributedDataParallel``        ``replicate``
``torch-fsdp2`` ``torch.distributed.fsdp.fully_shard`` per block    ``zero3``
=============  ===================================================  ===================

Both run the model the way DSpark does: fp32 parameters and AdamW, autocast for bf16 and fp16, the
same global batch split the same way. fp16 is DDP's only, with ``torch.amp.GradScaler`` as
PyTorch's AMP recipe writes it (from DSpark's initial scale and growth interval); under FSDP2 the
gradients are shards and GradScaler's overflow check sees only this rank's, so FSDP2 is refused
fp16 with that reason. FSDP2 wraps the same units as DSpark's zero3 (the model's
repeated blocks, then the root). Their AdamW is built as DSpark's is and keeps PyTorch's default
kernel (the loop on CPU), where DSpark's engine turns on the fused one; every result records the
kernel that ran (``optimizer_kernel``).

[Note: buffer policy] DDP broadcasts rank 0's module buffers (BatchNorm's running statistics) before
every forward by default; that is traffic and a copy per step. A fair comparison runs DSpark and
DDP under one policy, decided by what DSpark's engine does: when :class:`dspark.Engine` takes
``broadcast_buffers``, both run with buffers broadcast each forward; an engine without that option
never broadcasts, and DDP then runs with ``broadcast_buffers=False``. The policy is recorded with
every result (``buffer_sync``). FSDP2 has no buffer synchronisation at all; DeepSpeed broadcasts
rank 0's parameters once, at construction, and never its buffers.

[Note: estimated traffic] PyTorch's wrappers and DeepSpeed bypass DSpark's byte counters, so a
peer's traffic is not measured: :meth:`PeerEngine.estimated_traffic_per_step` (and DeepSpeed's
peer's) derives it from the algorithm and the parameter sizes, and results keep it in fields
named ``estimated_*``, never in the measured ones.

[Note: why this file uses torch.distributed directly] DSpark's own code reaches the process group
only through :mod:`dspark.comm`. A peer is the reference DSpark is measured against, so it must be
PyTorch's code path untouched; it still runs on the process group ``dspark.init`` created.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dspark.bench.measure.deepspeed_peer import DEEPSPEED_PEERS, DeepSpeedPeer, peer_precision
from dspark.comm import World
from dspark.engine import EngineConfig, LossScaler
from dspark.engine.for_the_lab import unit_modules, wire_bytes

__all__ = ["DEEPSPEED_PEERS", "FP16_PEERS", "PEERS", "TORCH_PEERS", "PeerEngine", "buffer_sync",
           "dspark_engine_options", "make_engine"]

TORCH_PEERS: dict[str, str] = {"torch-ddp": "replicate", "torch-fsdp2": "zero3"}
FP16_PEERS = ("torch-ddp",)
"""The peers measured in fp16 too (with ``torch.amp.GradScaler``); the others refuse it."""
"""PyTorch's peers: name -> the DSpark strategy it is compared with."""
PEERS: dict[str, str] = {**TORCH_PEERS, **DEEPSPEED_PEERS}
"""Every peer, DeepSpeed's included (whether or not DeepSpeed is installed): name -> the DSpark
strategy it is compared with."""


def _engine_accepts(engine_cls: type, name: str) -> bool:
    """Whether ``engine_cls`` takes option ``name``: by its signature, or, for an engine that takes
    its options as ``**options`` (:class:`dspark.EngineConfig`'s), by the config's names."""
    parameters = inspect.signature(engine_cls).parameters
    if name in parameters:
        return True
    takes_options = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return takes_options and name in EngineConfig().options()


def _default_engine() -> type:
    import dspark

    return dspark.Engine


def buffers_broadcast(engine_cls: type | None = None) -> bool:
    """Whether both DSpark and DDP broadcast buffers each forward (see [Note: buffer policy]).

    Example::

        buffers_broadcast()   # True once dspark.Engine takes broadcast_buffers
    """
    return _engine_accepts(engine_cls or _default_engine(), "broadcast_buffers")


def buffer_sync(strategy: str, engine_cls: type | None = None) -> str:
    """How ``strategy`` (a DSpark strategy or a peer) keeps module buffers equal, in words.

    Example::

        buffer_sync("torch-fsdp2")   # "none (FSDP2 does not synchronise buffers)"
    """
    if strategy == "torch-fsdp2":
        return "none (FSDP2 does not synchronise buffers)"
    if strategy in DEEPSPEED_PEERS:
        return "none (DeepSpeed broadcasts parameters once at construction, never buffers)"
    if buffers_broadcast(engine_cls):
        return "broadcast from rank 0 before every forward"
    return "none (broadcast once at construction)"


def dspark_engine_options(*, batch_placement: str, engine_cls: type | None = None) -> dict[str, Any]:
    """Keyword arguments for :class:`dspark.Engine` beyond the configuration, each passed only when
    the engine takes it, so the lab runs on engines before and after it gained them:

    * ``batch_check_every=None`` for a configuration that replicates the batch on purpose (the seed
      suite's bug), whose engine would otherwise stop it with a ``PlacementError``: the lab wants
      to measure and flag it, not prevent it;
    * ``broadcast_buffers=True`` (see [Note: buffer policy]).

    Example::

        dspark_engine_options(batch_placement="replicate")   # {"batch_check_every": None, ...}
    """
    engine_cls = engine_cls or _default_engine()
    options: dict[str, Any] = {}
    if batch_placement == "replicate" and _engine_accepts(engine_cls, "batch_check_every"):
        options["batch_check_every"] = None
    if _engine_accepts(engine_cls, "broadcast_buffers"):
        options["broadcast_buffers"] = True
    return options


class PeerEngine:
    """The slice of :class:`dspark.Engine`'s surface the benchmark worker uses, on a PyTorch wrapper.

    Example::

        engine = PeerEngine("torch-ddp", model, world, lr=3e-4, precision="bf16")
        engine.backward(loss_fn(engine(x), y)); engine.step()
    """

    def __init__(self, name: str, model: nn.Module, world: World, *, lr: float, precision: str,
                 broadcast_buffers: bool | None = None, grad_accum_steps: int = 1) -> None:
        policy = peer_precision(
            name, precision, known=TORCH_PEERS, scales=name in FP16_PEERS,
            scaler="a loss scaler whose overflow check sees every rank's gradient: PyTorch's "
                   "GradScaler checks this rank's shards only under FSDP2 (ranks could disagree "
                   "on skipping a step)")
        if isinstance(grad_accum_steps, bool) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={grad_accum_steps!r} must be an int >= 1")
        self.grad_accum_steps = grad_accum_steps
        self._micro_step = 0
        self.name = name
        self.world = world
        self._compute_dtype = policy.compute_dtype
        self._param_specs = [(p.shape, p.dtype) for p in model.parameters()]
        self._buffer_specs = [(b.shape, b.dtype) for b in model.buffers()]
        self.broadcast_buffers = (buffers_broadcast() if broadcast_buffers is None
                                  else broadcast_buffers) and name == "torch-ddp"
        if name == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [world.device.index] if world.device.type == "cuda" else None
            # PyTorch 2.13 renamed the switch (the old name warns); both sync buffers at construction
            sync_name = ("forward_sync_buffers" if "forward_sync_buffers"
                         in inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers")
            sync: dict[str, Any] = {sync_name: self.broadcast_buffers}
            self.module: nn.Module = DistributedDataParallel(model, device_ids=device_ids, **sync)
        else:
            from torch.distributed.fsdp import fully_shard

            from dspark.comm import device_mesh

            mesh = device_mesh()
            for _, unit in reversed(unit_modules(model)[1:]):  # blocks first, the root last
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.module = model
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        # fp16 (DDP): PyTorch's AMP recipe, from the initial scale and growth interval of DSpark's
        # LossScaler, so that both skip the same steps
        defaults = LossScaler()
        self._scaler = (torch.amp.GradScaler(world.device.type, init_scale=defaults.scale,
                                             growth_interval=defaults.growth_interval)
                        if policy.loss_scaling else None)
        self.options: dict[str, Any] = ({"grad_accum_steps": grad_accum_steps}
                                        if grad_accum_steps > 1 else {})
        """What the worker records as ``engine_options`` (a PyTorch peer takes none but the
        accumulation)."""

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.world.device.type, dtype=self._compute_dtype)

    def _sync_context(self) -> contextlib.AbstractContextManager[Any]:
        """Gradient accumulation as each wrapper's users write it: the window's last micro-batch
        synchronises; before it, DDP's forward runs under ``no_sync()`` (DDP decides in forward)
        and FSDP2 is told ``set_requires_gradient_sync(False)``."""
        if self.grad_accum_steps == 1:
            return contextlib.nullcontext()
        last = self._micro_step == self.grad_accum_steps - 1
        if self.name == "torch-ddp":
            return contextlib.nullcontext() if last else self.module.no_sync()  # type: ignore[operator]
        self.module.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._sync_context(), self._autocast():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        if self._micro_step >= self.grad_accum_steps:
            raise RuntimeError(f"peer {self.name!r}: more than grad_accum_steps="
                               f"{self.grad_accum_steps} backward() calls before step()")
        loss = loss / self.grad_accum_steps if self.grad_accum_steps > 1 else loss
        (loss if self._scaler is None else self._scaler.scale(loss)).backward()
        self._micro_step += 1

    def step(self) -> bool:
        """The optimizer step (fp16: ``GradScaler.step`` and ``update``). Returns True, as the
        loop a DDP user writes learns nothing of a skipped step: asking ``get_scale()`` would add
        a host synchronisation to every step of the peer."""
        if self._scaler is None:
            self.optimizer.step()
        else:
            self._scaler.step(self.optimizer)
            self._scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro_step = 0
        return True

    def estimated_traffic_per_step(self) -> tuple[int, int]:
        """``(payload bytes, ring wire bytes)`` one rank sends per step, ESTIMATED from the
        algorithm (see [Note: estimated traffic]): DDP all-reduces every gradient once and, with
        ``broadcast_buffers``, broadcasts the buffers before the forward; FSDP2 all-gathers every
        parameter twice (forward, backward) and reduce-scatters every gradient once."""
        n = self.world.world_size
        if n == 1:
            return 0, 0

        def nbytes(specs: list[tuple[torch.Size, torch.dtype]]) -> int:
            return sum(torch.empty(shape, dtype=dtype, device="meta").nbytes for shape, dtype in specs)

        grads = nbytes(self._param_specs)
        if self.name == "torch-ddp":
            buffers = nbytes(self._buffer_specs) if self.broadcast_buffers else 0
            return (grads + buffers,
                    wire_bytes("all_reduce", grads, n) + wire_bytes("broadcast", buffers, n))
        shard = grads // n
        return (2 * shard + grads,
                2 * wire_bytes("all_gather", shard, n) + wire_bytes("reduce_scatter", grads, n))

    def close(self) -> None:
        self.optimizer.state.clear()
        self.module = nn.Module()


def make_engine(strategy: str, model: nn.Module, world: World, *, lr: float, precision: str,
                options: dict[str, Any] | None = None, global_batch: int | None = None,
                grad_accum_steps: int = 1) -> Any:
    """DSpark's engine for a DSpark strategy (with ``options``, see :func:`dspark_engine_options`),
    a :class:`PeerEngine` for a PyTorch peer, a
    :class:`~dspark.bench.measure.deepspeed_peer.DeepSpeedPeer` for a DeepSpeed one (which needs the
    ``global_batch`` for its configuration). DSpark's engine and DeepSpeed get the same optimizer
    factory. ``grad_accum_steps``: backward calls per step, each on a micro-batch (every engine
    averages them).

    Example::

        make_engine("zero3", model, world, lr=3e-4, precision="bf16", options={})
    """
    factory: Callable[..., torch.optim.Optimizer] = functools.partial(torch.optim.AdamW, lr=lr)
    if strategy in TORCH_PEERS:
        return PeerEngine(strategy, model, world, lr=lr, precision=precision,
                          grad_accum_steps=grad_accum_steps)
    if strategy in DEEPSPEED_PEERS:
        if global_batch is None:
            raise ValueError(f"peer {strategy!r} needs global_batch for its DeepSpeed configuration")
        return DeepSpeedPeer(strategy, model, world, lr=lr, precision=precision,
                             global_batch=global_batch, optimizer=factory,
                             grad_accum_steps=grad_accum_steps)
    import dspark

    return dspark.Engine(model, optimizer=factory, strategy=strategy, precision=precision,
                         grad_accum_steps=grad_accum_steps, **(options or {}))
