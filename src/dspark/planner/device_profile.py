"""Devices as well as links: a device's compute and memory rates, so that a plan made from a probe
on one device can be read for another.

[Note: device profiles] A probe measures one device (:mod:`dspark.planner.probe`): its forward and
backward times, its optimizer step, its copies. A plan "for two DGX Sparks" made on a CPU or an H200
would otherwise be that device's compute over a Spark's link. :func:`scale_probe` reads the probe
for another device by the ratio of their rates:

* forward and backward (matrix multiplies): by the ratio of dense 16-bit tensor throughput
  (``compute_flops_per_s``);
* the optimizer step and the engine's copies (each element read and written once, no reuse): by
  the ratio of memory bandwidth (``memory_bytes_per_s``);
* memory (the tensors a step holds) does not change with the device; the process around them does
  (a CUDA context is not a CPU's libraries), so a scaled probe predicts no process peak.

The GPU profiles' numbers are datasheet constants, not measurements, each with its source in
``source``: peak rates that real kernels reach only in part, so a scaled step is optimistic by the
share of its peak the target reaches less than the probe's device did. The CPU's profile is
measured (:func:`measured_cpu_profile`): a matrix multiply and a copy on this machine, as the probe
runs them (one thread per rank). Scaling from a measured CPU to a GPU's datasheet peak therefore
overstates the GPU most: read such a plan's steps as a lower bound, its memory as exact.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from types import MappingProxyType

import psutil
import torch

from dspark.planner.probe_record import Line, Probe

__all__ = ["DEVICES", "DeviceProfile", "get_device_profile", "measured_cpu_profile", "profile_of", "scale_probe"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    """One device's rates, as :func:`scale_probe` reads them (see [Note: device profiles])."""

    name: str
    """What the plan prints, e.g. ``"NVIDIA GB10 (DGX Spark)"``."""
    compute_flops_per_s: float
    """Dense 16-bit (bf16/fp16) tensor throughput, floating-point operations per second."""
    memory_bytes_per_s: float
    """Memory bandwidth: bytes read plus bytes written per second."""
    memory_bytes: int
    """The memory a rank's process can use: the GPU's own, or the whole unified memory."""
    unified_memory: bool = False
    """The CPU and the GPU share ``memory_bytes`` (GB10): the host process counts against it too."""
    source: str
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        if not (self.compute_flops_per_s > 0 and self.memory_bytes_per_s > 0 and self.memory_bytes > 0):
            raise ValueError(f"device {self.name!r}: compute_flops_per_s={self.compute_flops_per_s!r}, "
                             f"memory_bytes_per_s={self.memory_bytes_per_s!r} and "
                             f"memory_bytes={self.memory_bytes!r} must all be > 0")


DEVICES: MappingProxyType[str, DeviceProfile] = MappingProxyType({
    "h100": DeviceProfile(
        name="NVIDIA H100 SXM", compute_flops_per_s=989e12, memory_bytes_per_s=3.35e12, memory_bytes=80 * 10**9,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity, "
               "989 dense; HBM3 3.35 TB/s; 80 GB"),
    "h200": DeviceProfile(
        name="NVIDIA H200 SXM", compute_flops_per_s=989e12, memory_bytes_per_s=4.8e12, memory_bytes=141 * 10**9,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity, "
               "989 dense; HBM3e 4.8 TB/s; 141 GB"),
    "gb10": DeviceProfile(
        name="NVIDIA GB10 (DGX Spark)", compute_flops_per_s=125e12, memory_bytes_per_s=273e9,
        memory_bytes=128 * 10**9, unified_memory=True,
        source="NVIDIA DGX Spark datasheet: 1 PFLOP FP4 with sparsity, 128 GB LPDDR5x unified memory, "
               "273 GB/s. The BF16 rate is derived, not a datasheet line: FP4's 1 PFLOP halved for dense "
               "and halved again for each doubling of the width (FP8, then BF16)"),
})
"""The datasheet profiles by name (see [Note: device profiles])."""


def get_device_profile(name: str) -> DeviceProfile:
    """The profile ``name`` of :data:`DEVICES`.

    Example::

        get_device_profile("gb10").memory_bytes   # the DGX Spark's unified memory, in bytes
    """
    if name not in DEVICES:
        raise ValueError(f"device profile {name!r} is not one of {', '.join(DEVICES)}")
    return DEVICES[name]


def profile_of(probe_device: str) -> DeviceProfile:
    """The profile of the device a probe ran on (``Probe.device``): the datasheet profile its name
    contains (``"NVIDIA H200 ..."``), or this CPU measured now for ``"cpu"``.

    Example::

        profile_of("NVIDIA H200 (kept artifact)").name   # "NVIDIA H200 SXM"
    """
    text = probe_device.lower()
    for key, profile in DEVICES.items():
        if key in text:
            return profile
    if text.startswith("cpu"):
        return measured_cpu_profile()
    raise ValueError(f"the probe's device {probe_device!r} has no profile: probe on a CPU or on one of "
                     f"{', '.join(DEVICES)} to read the plan for another device")


def _best_s(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def measured_cpu_profile(size: int = 512, copy_bytes: int = 32 << 20, repeats: int = 5) -> DeviceProfile:
    """This CPU's profile, measured now in this process (its thread setting, as a rank runs): a
    ``size`` x ``size`` fp32 matrix multiply for compute, a copy of ``copy_bytes`` for memory (each
    byte read and written: twice the bytes counted). The best of ``repeats``.

    Example::

        measured_cpu_profile().compute_flops_per_s   # this core's fp32 matmul rate
    """
    a, b = torch.randn(size, size), torch.randn(size, size)
    src, dst = torch.empty(copy_bytes // 4), torch.empty(copy_bytes // 4)
    dst.copy_(src)  # first touch: pages mapped before timing
    matmul_s = _best_s(lambda: torch.mm(a, b), repeats)
    copy_s = _best_s(lambda: dst.copy_(src), repeats)
    return DeviceProfile(name=f"this CPU ({torch.get_num_threads()} thread(s))",
                         compute_flops_per_s=2 * size**3 / matmul_s, memory_bytes_per_s=2 * copy_bytes / copy_s,
                         memory_bytes=int(psutil.virtual_memory().total), unified_memory=True,
                         source=f"measured here: a {size}x{size} fp32 matmul and a {copy_bytes >> 20} MiB copy, "
                                f"best of {repeats}")


def _times(line: Line, factor: float) -> Line:
    return Line(fixed=line.fixed * factor, per_sample=line.per_sample * factor)


def scale_probe(probe: Probe, source: DeviceProfile, target: DeviceProfile) -> Probe:
    """``probe`` (measured on ``source``) read for ``target`` (see [Note: device profiles]): forward
    and backward by the compute ratio, the optimizer step and copies by the memory-bandwidth ratio,
    memory unchanged, no process baseline. Its ``device`` says so, and the plan prints it.

    Example::

        scale_probe(probe, measured_cpu_profile(), get_device_profile("gb10")).device
        # "NVIDIA GB10 (DGX Spark), scaled from cpu: compute rate x..., memory rate x... (...)"
    """
    compute = source.compute_flops_per_s / target.compute_flops_per_s  # time factor
    memory = source.memory_bytes_per_s / target.memory_bytes_per_s
    return dataclasses.replace(
        probe,
        device=(f"{target.name}, scaled from {probe.device}: compute rate x{1 / compute:.3g}, memory rate "
                f"x{1 / memory:.3g} ({source.name} to {target.name}'s datasheet rates)"),
        forward_ms=_times(probe.forward_ms, compute), backward_ms=_times(probe.backward_ms, compute),
        forward_ms_rounds=tuple(_times(line, compute) for line in probe.forward_ms_rounds),
        backward_ms_rounds=tuple(_times(line, compute) for line in probe.backward_ms_rounds),
        optimizer_ms=probe.optimizer_ms * memory, optimizer_fixed_ms=probe.optimizer_fixed_ms * memory,
        optimizer_ms_rounds=tuple(ms * memory for ms in probe.optimizer_ms_rounds),
        copy_bytes_per_s=probe.copy_bytes_per_s / memory if probe.copy_bytes_per_s else 0.0,
        per_copy_s=probe.per_copy_s * memory,
        check_bytes_per_s=probe.check_bytes_per_s / memory if probe.check_bytes_per_s else 0.0,
        process_baseline_bytes=0)
