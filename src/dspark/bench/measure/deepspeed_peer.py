"""DeepSpeed's ZeRO stages as peers of DSpark's zero1, zero2 and zero3: an optional extra
(``make peers``), measured by the same worker, on the process group ``dspark.init`` created.

===================  ==========================  ==================
peer                 DeepSpeed                   DSpark counterpart
===================  ==========================  ==================
``deepspeed-zero1``  ZeRO stage 1                ``zero1``
``deepspeed-zero2``  ZeRO stage 2                ``zero2``
``deepspeed-zero3``  ZeRO stage 3                ``zero3``
===================  ==========================  ==================

[Note: a DeepSpeed peer's configuration] :func:`deepspeed_config` writes it; the worker records it
with every result (``engine_options["deepspeed_config"]``). What it pins, and why:

* the same model, global batch and split as DSpark (``train_micro_batch_size_per_gpu`` is this
  rank's share, one micro-step per step);
* the same optimizer, built the same way: the worker's ``AdamW`` factory over the model's
  parameters, handed to DeepSpeed as its client optimizer, with PyTorch's fused kernel turned on by
  the rule DSpark's engine applies to its own (see [Note: fused optimizer] in
  :mod:`dspark.policy.optimizer_kernel`). The kernel that ran is recorded on both sides
  (``optimizer_kernel``);
* ``gradient_clipping: 0``: DeepSpeed clips at 1.0 unless told otherwise, DSpark's runs do not clip;
  and, for stages 1 and 2, ``compute_grad_norm: false`` (DeepSpeed's own switch for "no clipping,
  nobody reads the norm"): DSpark computes no norm it does not need either;
* ``reduce_bucket_size`` and ``allgather_bucket_size``: DSpark's ``bucket_mb`` (the engine's
  default) as fp32 elements, the unit DeepSpeed counts in;
* ``overlap_comm``: DeepSpeed's default per stage (off for 1 and 2, on for 3), written out. On its
  CPU accelerator there are no streams, so neither value overlaps anything there; on CUDA the
  defaults are what DeepSpeed ships;
* the ZeRO-3 knobs stay DeepSpeed's defaults (``stage3_param_persistence_threshold``: parameters of
  at most 1e5 elements are kept whole, not sharded);
* fp32, or bf16 through DeepSpeed's ``torch_autocast`` section: fp32 parameters and optimizer,
  autocast compute, as DSpark and the PyTorch peers run bf16 (DeepSpeed then reduces the gradients
  of Linear and Conv layers in bf16). DeepSpeed's ``bf16`` section (bf16 weights with an fp32
  master copy) is a different memory trade and is not what is measured. fp16 needs loss scaling,
  which the comparison does not model: refused, as for the PyTorch peers.

On CPU, DeepSpeed needs ``DS_ACCELERATOR=cpu`` before it is imported; the peer sets it when the
rank's device is a CPU core. DeepSpeed's CPU accelerator builds a small shared-memory C++ op the
first time a process group is wrapped (about a minute, cached in PyTorch's extension directory);
``make peers`` builds it once so that no timed run waits for a compiler.

Like the PyTorch peers, DeepSpeed's collectives bypass DSpark's byte counters: its traffic is
ESTIMATED (see [Note: estimated traffic] in :mod:`dspark.bench.measure.peers`).
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Collection, MutableMapping
from typing import Any

import torch
from torch import nn

from dspark.comm import World
from dspark.engine import EngineConfig, PrecisionPolicy
from dspark.engine.for_the_lab import precision_policy, prefer_fused_kernel, wire_bytes

__all__ = ["DEEPSPEED_PEERS", "INSTALL_HINT", "DeepSpeedPeer", "deepspeed_config",
           "deepspeed_missing", "dspark_bucket_mb", "peer_precision", "require_deepspeed"]

DEEPSPEED_PEERS: dict[str, str] = {"deepspeed-zero1": "zero1", "deepspeed-zero2": "zero2",
                                   "deepspeed-zero3": "zero3"}
"""Peer name -> the DSpark strategy it is compared with."""

INSTALL_HINT = ("install DeepSpeed with `make peers` (the `peers` extra: pip install "
                "-c constraints.txt --no-build-isolation -e '.[peers]')")

_STAGE = {"deepspeed-zero1": 1, "deepspeed-zero2": 2, "deepspeed-zero3": 3}
_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold``: smaller parameters stay whole."""
_CHECK_TIMEOUT_S = 300


def _accelerator_env(env: MutableMapping[str, str], device_type: str) -> None:
    if device_type == "cpu":
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed would otherwise look for CUDA and fail


@functools.cache
def deepspeed_missing() -> str | None:
    """None when ``import deepspeed`` works here; else why not, in one line. Checked once, in a
    fresh interpreter, so DeepSpeed's import-time set-up never runs in the calling process.

    Example::

        deepspeed_missing()   # "DeepSpeed is not installed" without the peers extra
    """
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed"
    env = dict(os.environ)
    _accelerator_env(env, "cuda" if torch.cuda.is_available() else "cpu")
    try:
        done = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, text=True,
                              capture_output=True, timeout=_CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"`import deepspeed` took more than {_CHECK_TIMEOUT_S} s"
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return f"`import deepspeed` failed: {lines[-1] if lines else f'exit code {done.returncode}'}"
    return None


def require_deepspeed(names: list[str] | tuple[str, ...]) -> None:
    """Raise a ``ValueError`` naming ``make peers`` when ``names`` holds a DeepSpeed peer and
    DeepSpeed does not import here.

    Example::

        require_deepspeed(["zero2", "deepspeed-zero2"])
    """
    wanted = [name for name in names if name in DEEPSPEED_PEERS]
    if not wanted:
        return
    why = deepspeed_missing()
    if why is not None:
        raise ValueError(f"{', '.join(wanted)} need{'s' if len(wanted) == 1 else ''} DeepSpeed, "
                         f"and {why}: {INSTALL_HINT}")


def dspark_bucket_mb(engine_cls: type | None = None) -> float:
    """The ``bucket_mb`` DSpark's engine runs with in the lab (its default: the lab passes none).

    Example::

        dspark_bucket_mb()   # 25.0
    """
    if engine_cls is None:
        import dspark

        engine_cls = dspark.Engine
    parameter = inspect.signature(engine_cls).parameters.get("bucket_mb")
    return float(EngineConfig().communication.bucket_mb if parameter is None else parameter.default)


def peer_precision(name: str, precision: str, *, known: Collection[str],
                   scaler: str, scales: bool = False) -> PrecisionPolicy:
    """The precision policy of peer ``name`` (one of ``known``): fp32 or bf16, and fp16 where the
    peer runs ``scaler`` (``scales=True``); elsewhere fp16 is refused with ``scaler``'s reason.

    Example::

        peer_precision("torch-ddp", "fp16", known=["torch-ddp"], scaler="PyTorch's GradScaler",
                       scales=True)
    """
    if name not in known:
        raise ValueError(f"peer={name!r} is not one of {', '.join(map(repr, known))}")
    policy = precision_policy(precision)
    if policy.loss_scaling and not scales:
        raise ValueError(f"peer {name!r} is measured in fp32 or bf16; precision={precision!r} "
                         f"would need {scaler}")
    return policy


def deepspeed_config(name: str, *, global_batch: int, world_size: int, precision: str,
                     bucket_mb: float, grad_accum_steps: int = 1) -> dict[str, Any]:
    """The DeepSpeed configuration of peer ``name`` (see [Note: a DeepSpeed peer's configuration]).

    Example::

        deepspeed_config("deepspeed-zero2", global_batch=16, world_size=2, precision="fp32",
                         bucket_mb=25.0)["zero_optimization"]["reduce_bucket_size"]   # 6553600
    """
    policy = peer_precision(name, precision, known=_STAGE,
                            scaler="DeepSpeed's loss scaler, which the comparison does not model")
    if global_batch < 1 or global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} does not split evenly over {world_size} ranks")
    if grad_accum_steps < 1 or (global_batch // world_size) % grad_accum_steps:
        raise ValueError(f"grad_accum_steps={grad_accum_steps} does not split a rank's "
                         f"{global_batch // world_size} samples evenly")
    stage = _STAGE[name]
    bucket_elements = int(bucket_mb * 2**20) // 4  # fp32 gradients: DeepSpeed counts elements
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket_elements,
                            "allgather_bucket_size": bucket_elements, "overlap_comm": stage == 3,
                            "contiguous_gradients": True}
    if stage in (1, 2):
        zero["compute_grad_norm"] = False
    config: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // world_size // grad_accum_steps,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,  # no progress lines inside timed steps
        "wall_clock_breakdown": False,
    }
    if policy.compute_dtype is not None:
        dtype = str(policy.compute_dtype).removeprefix("torch.")
        config["torch_autocast"] = {"enabled": True, "dtype": dtype}
    return config


def _import_deepspeed(device: torch.device) -> Any:
    _accelerator_env(os.environ, device.type)
    try:
        return importlib.import_module("deepspeed")
    except ImportError as exc:
        raise ImportError(f"the DeepSpeed peers need DeepSpeed ({exc}); {INSTALL_HINT}") from exc


class DeepSpeedPeer:
    """A DeepSpeed ZeRO engine under the slice of :class:`dspark.Engine`'s surface the benchmark
    worker uses (see :class:`dspark.bench.measure.peers.PeerEngine`).

    Example::

        peer = DeepSpeedPeer("deepspeed-zero2", model, world, lr=3e-4, precision="fp32",
                             global_batch=16)
        peer.backward(loss_fn(peer(x), y)); peer.step()
    """

    def __init__(self, name: str, model: nn.Module, world: World, *, lr: float, precision: str,
                 global_batch: int,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 grad_accum_steps: int = 1) -> None:
        import torch.distributed as dist

        self.config = deepspeed_config(name, global_batch=global_batch,
                                       world_size=world.world_size, precision=precision,
                                       bucket_mb=dspark_bucket_mb(),
                                       grad_accum_steps=grad_accum_steps)
        self.grad_accum_steps = grad_accum_steps
        self._micro_step = 0
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"peer {name!r} runs on the process group dspark.init() creates; "
                               "launch it with `dspark run` (or dspark.init(backend='gloo'))")
        deepspeed = _import_deepspeed(world.device)
        from deepspeed.accelerator import get_accelerator

        if precision_policy(precision).compute_dtype is not None and (
                not get_accelerator().is_bf16_supported()):
            raise ValueError(f"peer {name!r}: DeepSpeed's {get_accelerator().device_name()} "
                             f"accelerator does not support precision={precision!r} here")
        self.name = name
        self.world = world
        factory = optimizer or functools.partial(torch.optim.AdamW, lr=lr)
        client = factory(model.parameters())
        prefer_fused_kernel(client)  # the rule DSpark's engine applies to its own optimizer
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client,
                                               config=copy.deepcopy(self.config),
                                               dist_init_required=False)
        self._engine: Any = engine
        self.module: nn.Module = engine.module
        self.optimizer: torch.optim.Optimizer = client
        """The client optimizer: its parameter groups now hold DeepSpeed's fp32 partitions."""
        self.options: dict[str, Any] = {"deepspeed_version": str(deepspeed.__version__),
                                        "deepspeed_config": self.config}
        """What the worker records as ``engine_options``."""
        # (elements, bytes per element on the wire) per parameter, read once DeepSpeed set them:
        # ZeRO-3 keeps the whole size in ds_numel; torch_autocast gives Linear/Conv a bf16 comm_dtype.
        self._comm_specs = [
            (int(getattr(p, "ds_numel", p.numel())),
             torch.empty((), dtype=getattr(p, "comm_dtype", p.dtype)).element_size(),
             torch.empty((), dtype=p.dtype).element_size())
            for p in self.module.parameters() if p.requires_grad]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides the loss by gradient_accumulation_steps itself, and wants its step()
        # after every micro-batch: it applies the optimizer only at the window's boundary
        self._engine.backward(loss)
        self._micro_step += 1
        if self._micro_step < self.grad_accum_steps:
            self._engine.step()

    def step(self) -> bool:
        self._engine.step()  # zeroes the gradients too
        self._micro_step = 0
        return True

    def estimated_traffic_per_step(self) -> tuple[int, int]:
        """``(payload bytes, ring wire bytes)`` one rank sends per step, ESTIMATED from the
        algorithm: stages 1 and 2 all-reduce every gradient (in its ``comm_dtype``) and all-gather
        the updated fp32 shards; stage 3 gathers every parameter above the persistence threshold in
        forward and again in backward and reduce-scatters every gradient (an upper bound: DeepSpeed
        may keep parameters gathered from forward to backward)."""
        n = self.world.world_size
        if n == 1:
            return 0, 0
        grads = sum(numel * comm for numel, comm, _ in self._comm_specs)
        if self.config["zero_optimization"]["stage"] in (1, 2):
            shard = sum(numel * size for numel, _, size in self._comm_specs) // n
            return (grads + shard,
                    wire_bytes("all_reduce", grads, n) + wire_bytes("all_gather", shard, n))
        shard = sum(numel * comm for numel, comm, _ in self._comm_specs
                    if numel > _PERSISTENCE_THRESHOLD) // n
        return (2 * shard + grads,
                2 * wire_bytes("all_gather", shard, n) + wire_bytes("reduce_scatter", grads, n))

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            destroy = getattr(engine, "destroy", None)
            if callable(destroy):
                destroy()
        self.optimizer.state.clear()
        self.module = nn.Module()
