"""The benchmark suites, as lists of :class:`BenchConfig`.

* ``quick`` (the default): the CPU presets on 1 and 2 devices, batch sharded, each preset's own
  batch, in its own precision where this CPU runs that faster than fp32, else fp32
  (:mod:`dspark.bench.measure.cpu_precision`). Sized to be the short check ``make bench`` runs on a
  2-core machine, start-up included.
* ``seed``: the article's table. Per workload: 1 device; N devices with the batch *replicated*
  (the seed's bug, on purpose); N devices sharded. On CPU the presets; with 2 or more GPUs the
  real ResNet-50 and GPT-2 124M, whose defaults are the article's (global batch 256, fp16).
* ``peers``: DSpark's replicate and zero3 beside PyTorch's DDP and FSDP2 (:mod:`dspark.bench.measure.peers`)
  on the CPU presets, 1 and 2 devices: a speedup claim checked against PyTorch's own tools. When
  DeepSpeed imports (the optional ``peers`` extra, ``make peers``), also zero1, zero2 and zero3
  beside DeepSpeed's ZeRO stages (:mod:`dspark.bench.measure.deepspeed_peer`); without it they are skipped
  with one line saying how to install them. Precision as in ``quick``.
* ``full``: the real sizes, every strategy, 1 to all GPUs (needs at least 2).

Every default can be overridden (:class:`SuiteOverrides`); a device count the machine does not
have is an error, not a silent oversubscription: on CPU one device is one core.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dspark.bench.measure import deepspeed_peer
from dspark.bench.measure.cpu_precision import choose_cpu_precision, cpu_matmul_ms
from dspark.bench.measure.peers import DEEPSPEED_PEERS, FP16_PEERS, PEERS
from dspark.bench.result import BenchConfig
from dspark.engine import PRECISIONS, STRATEGIES

__all__ = ["SUITES", "Machine", "SuiteOverrides", "build_suite", "check_devices"]

SUITES = ("quick", "seed", "peers", "full")

_log = logging.getLogger(__name__)

_CPU_WORKLOADS = ("resnet50-cpu", "gpt2-cpu")
_GPU_WORKLOADS = ("resnet50", "gpt2-124m")
_DEFAULT_STRATEGY = "replicate"
# (warm-up, measured) steps per launch; a run launches each configuration in 3 rounds (see
# dspark.bench.measure.runner), so a result has three times the timed steps. On CPU only a launch's first
# step is slow (first-touch pages, optimizer state, the engine's bucket order), the second already
# within the spread of the rest, so one warm-up step is enough. The first round runs 2 untimed probe
# steps instead. A CPU step takes under a second and a launch's start-up (interpreter, torch, the
# launcher) several, so `quick` (12 launches, 12 timed steps per configuration) stays within a couple
# of minutes on a 2-core machine.
_CPU_STEPS = (1, 4)
# The seed table compares runs a few percent apart (a replicated batch on CPU costs each rank the
# whole compute plus the all-reduce): two steps more per launch narrow the medians.
_CPU_SEED_STEPS = (1, 6)
_GPU_STEPS = (5, 20)
# suites whose precision follows this CPU's speed (the seed suite keeps the presets': the article's)
_MACHINE_PRECISION_SUITES = ("quick", "peers")
# the peers suite: each DSpark strategy beside the tools it stands in for
_TORCH_PEER_STRATEGIES = ("replicate", "torch-ddp", "zero3", "torch-fsdp2")
_ALL_PEER_STRATEGIES = ("replicate", "torch-ddp", "zero1", "deepspeed-zero1", "zero2",
                        "deepspeed-zero2", "zero3", "torch-fsdp2", "deepspeed-zero3")


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """The devices a suite may use."""

    num_gpus: int
    """CUDA devices visible to this process."""
    num_cpu_cores: int
    """Cores this process may run on (its CPU affinity)."""
    cpu_matmul_ms: tuple[tuple[str, float], ...] = ()
    """``(precision, ms)`` of a 512 x 512 matmul on one core (:mod:`dspark.bench.measure.cpu_precision`);
    measured by :meth:`detect` on a CPU-only machine, empty when unknown (presets keep their
    precision)."""

    @classmethod
    def detect(cls, *, time_matmuls: bool = True) -> Machine:
        """This machine; on CPU with ``time_matmuls``, also its fp32 and bf16 matmul timings (the
        CPU presets' precision).

        Example::

            Machine.detect()   # Machine(num_gpus=0, num_cpu_cores=2, cpu_matmul_ms=(('fp32', 1.9), ...))
        """
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        timings = () if gpus or not time_matmuls else tuple(cpu_matmul_ms(("fp32", "bf16")).items())
        return cls(num_gpus=gpus, num_cpu_cores=cores or 1, cpu_matmul_ms=timings)

    @property
    def device_kind(self) -> str:
        """``"GPU"`` when CUDA devices are visible (the workers then use them), else ``"CPU core"``."""
        return "GPU" if self.num_gpus else "CPU core"

    @property
    def num_devices(self) -> int:
        return self.num_gpus or self.num_cpu_cores


@dataclass(frozen=True, kw_only=True, slots=True)
class SuiteOverrides:
    """Choices that replace a suite's defaults; ``None`` / empty keeps the default."""

    workloads: tuple[str, ...] = ()
    """Workload names from ``dspark.models``."""
    devices: tuple[int, ...] = ()
    """Device counts; the seed suite runs its replicated and sharded pair at each count > 1."""
    strategies: tuple[str, ...] = ()
    """Engine strategies: replicate, zero1, zero2, zero3."""
    precision: str | None = None
    """fp32, fp16 or bf16 for every configuration (default: each workload's own)."""
    global_batch: int | None = None
    """Samples per step across all devices (default: each workload's own)."""
    max_micro_batch: int | None = None
    """Samples per forward/backward pass on a rank at most (default: each workload's own limit)."""
    warmup_steps: int | None = None
    measure_steps: int | None = None


def _valid(kind: str, values: Sequence[str], valid: Sequence[str]) -> None:
    unknown = [v for v in values if v not in valid]
    if unknown:
        raise ValueError(f"unknown {kind} {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")


def check_devices(devices: Sequence[int], machine: Machine) -> None:
    """Refuse device counts this machine does not have (on CPU one device is one core).

    Example::

        check_devices([1, 2], Machine.detect())   # ValueError on a 1-core machine
    """
    bad = [d for d in devices if isinstance(d, bool) or not isinstance(d, int) or d < 1]
    if bad:
        raise ValueError(f"devices={list(devices)!r}: every device count must be an int >= 1")
    need = max(devices)
    if need > machine.num_devices:
        hint = (" (or hide the GPUs with CUDA_VISIBLE_DEVICES= to run on CPU cores)"
                if machine.num_gpus else "")
        raise ValueError(
            f"devices={list(devices)!r} needs {need} devices, but this machine has "
            f"{machine.num_devices} {machine.device_kind}(s) (one device = one "
            f"{machine.device_kind}); choose device counts in 1..{machine.num_devices}{hint}")


def _full_device_counts(num_gpus: int) -> tuple[int, ...]:
    counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= num_gpus]
    return tuple(counts + ([num_gpus] if num_gpus not in counts else []))


def _suite_defaults(name: str, machine: Machine) -> tuple[tuple[str, ...], tuple[int, ...],
                                                        tuple[str, ...]]:
    """(workloads, devices, strategies) of a suite on ``machine``."""
    if name == "quick":
        return _CPU_WORKLOADS, (1, 2), (_DEFAULT_STRATEGY,)
    if name == "seed":
        return (_GPU_WORKLOADS if machine.num_gpus >= 2 else _CPU_WORKLOADS), (1, 2), (_DEFAULT_STRATEGY,)
    if name == "peers":
        return _CPU_WORKLOADS, (1, 2), _TORCH_PEER_STRATEGIES  # DeepSpeed's: see build_suite
    if machine.num_gpus < 2:
        raise ValueError(
            f"suite 'full' measures the real-size models ({', '.join(_GPU_WORKLOADS)}) on 1 to all "
            f"GPUs and needs at least 2 CUDA devices; this machine has {machine.num_gpus}. "
            "Run `dspark bench --suite seed` (the article's table on the CPU presets) or "
            "`dspark bench --suite quick` instead")
    return _GPU_WORKLOADS, _full_device_counts(machine.num_gpus), tuple(STRATEGIES)


def _peer_strategies() -> tuple[str, ...]:
    """The peers suite's strategies: DeepSpeed's stages only where DeepSpeed imports."""
    missing = deepspeed_peer.deepspeed_missing()
    if missing is not None:
        _log.warning("suite 'peers': skipping the DeepSpeed peers %s (%s); %s",
                     ", ".join(DEEPSPEED_PEERS), missing, deepspeed_peer.INSTALL_HINT)
        return _TORCH_PEER_STRATEGIES
    return _ALL_PEER_STRATEGIES


def _default_precision(suite: str, preset: str, machine: Machine,
                       switched: dict[str, str]) -> str:
    """The preset's precision, except on a CPU that runs it slower than fp32 in ``quick`` and
    ``peers`` (see :mod:`dspark.bench.measure.cpu_precision`); ``switched`` collects why, by preset."""
    if suite not in _MACHINE_PRECISION_SUITES or machine.num_gpus:
        return preset
    choice = choose_cpu_precision(preset, dict(machine.cpu_matmul_ms))
    if choice.precision != preset:
        switched[preset] = choice.reason
    return choice.precision


def build_suite(name: str = "quick", overrides: SuiteOverrides | None = None, *,
                machine: Machine | None = None) -> list[BenchConfig]:
    """The configurations of suite ``name`` on ``machine`` (default: this one), with
    ``overrides`` applied, in the order they should run (each workload's 1-device baseline first).

    Example::

        build_suite("seed")   # 1 device; 2 devices replicated; 2 devices sharded; per workload
        build_suite("quick", SuiteOverrides(workloads=("gpt2-cpu",), measure_steps=3))
    """
    from dspark.models import get_workload

    if name not in SUITES:
        raise ValueError(f"suite={name!r} is not one of {', '.join(SUITES)}")
    overrides = overrides or SuiteOverrides()
    machine = machine or Machine.detect(
        time_matmuls=name in _MACHINE_PRECISION_SUITES and overrides.precision is None)
    workloads, devices, strategies = _suite_defaults(name, machine)
    workloads = overrides.workloads or workloads
    devices = tuple(sorted(set(overrides.devices or devices)))
    if name == "peers" and not overrides.strategies:
        strategies = _peer_strategies()
    strategies = overrides.strategies or strategies
    _valid("strategy", strategies, (*STRATEGIES, *PEERS))
    if overrides.strategies:
        deepspeed_peer.require_deepspeed(overrides.strategies)
    if overrides.precision is not None:
        _valid("precision", (overrides.precision,), tuple(PRECISIONS))
        peers = [s for s in strategies if s in PEERS and s not in FP16_PEERS]
        if peers and PRECISIONS[overrides.precision].loss_scaling:
            raise ValueError(f"--precision {overrides.precision} with peer(s) {', '.join(peers)}: "
                             "these peers are measured in fp32 or bf16 (fp16 needs a loss scaler "
                             "that sees every rank's gradient shards, which neither PyTorch's "
                             "GradScaler under FSDP2 nor the comparison of DeepSpeed's has); use "
                             "--precision bf16, or DSpark's strategies with torch-ddp alone")
    check_devices(devices, machine)
    warmup, measure = (_GPU_STEPS if machine.num_gpus
                       else _CPU_SEED_STEPS if name == "seed" else _CPU_STEPS)
    steps = {"warmup_steps": warmup if overrides.warmup_steps is None else overrides.warmup_steps,
             "measure_steps": measure if overrides.measure_steps is None else overrides.measure_steps}

    configs = []
    switched: dict[str, str] = {}  # preset precision -> why this CPU runs fp32 instead
    in_fp32: dict[str, list[str]] = {}  # preset precision -> its workloads run in fp32
    for workload_name in workloads:
        workload = get_workload(workload_name)  # unknown names raise, listing the valid ones
        precision = overrides.precision or _default_precision(name, workload.default_precision,
                                                              machine, switched)
        if precision != workload.default_precision and not overrides.precision:
            in_fp32.setdefault(workload.default_precision, []).append(workload_name)
        global_batch = (workload.default_global_batch if overrides.global_batch is None
                        else overrides.global_batch)
        uneven = [n for n in devices if global_batch % n]
        if uneven and (overrides.devices or overrides.global_batch is not None):
            raise ValueError(f"global batch {global_batch} of {workload_name!r} does not split evenly "
                             f"over {', '.join(map(str, uneven))} devices; choose a global batch "
                             f"divisible by every device count in {list(devices)}")
        if uneven:  # a default count (e.g. all 6 GPUs) the default batch does not fit: skip it
            _log.warning("suite %r: skipping %s devices for %s: global batch %d does not split "
                         "evenly", name, ", ".join(map(str, uneven)), workload_name, global_batch)
        for strategy in strategies:
            common: dict[str, Any] = {"workload": workload_name, "strategy": strategy, "precision": precision,
                      "global_batch": global_batch, "max_micro_batch": overrides.max_micro_batch,
                      **steps}
            for num_devices in (n for n in devices if n not in uneven):
                if name == "seed" and num_devices > 1:
                    configs.append(BenchConfig(num_devices=num_devices, batch_placement="replicate",
                                               **common))
                configs.append(BenchConfig(num_devices=num_devices, batch_placement="shard", **common))
    for preset, reason in switched.items():
        _log.warning("suite %r: %s in fp32, not the presets' %s: this CPU runs %s slower (%s); pass "
                     "--precision %s to measure it anyway", name, ", ".join(in_fp32[preset]), preset, preset,
                     reason, preset)
    return configs
