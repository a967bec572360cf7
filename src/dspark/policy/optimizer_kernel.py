"""The optimizer's kernel: PyTorch's fused one where the user left the choice open.

[Note: fused optimizer] ``torch.optim.Adam``, ``AdamW`` and ``SGD`` step every parameter with a
Python loop of small kernels unless told ``foreach=True`` or ``fused=True``; on CPU the default is
the loop. The fused kernel does the same arithmetic in one pass per tensor, several times faster
than the loop and ``foreach`` on one core (``benchmarks/optimizer_kernel.py``:
docs/figures.md#optimizer-kernel). Under every strategy the
engine hands the optimizer plain dense tensors it owns (whole parameters, or this rank's shards), so
the fused kernel always applies. It is turned on only where every parameter group left both
``fused`` and ``foreach`` unset (``None``): ``optimizer=functools.partial(torch.optim.AdamW,
fused=False)`` (or ``foreach=...``) keeps the user's choice. Results differ from the loop by rounding
only (the parity tests compare against the loop at 1e-5).

SGD with momentum keeps the loop: PyTorch's fused SGD fails (``TypeError: expected Tensor as
element 1 in argument 2, but got NoneType``, torch 2.13) when some parameters have a momentum
buffer and others not yet, i.e. whenever a parameter gets its first gradient after the first
step (a branch skipped at first, a head trained later); the loop and ``foreach`` handle it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach, _get_fused_kernels_supported_devices

__all__ = ["kernel_name", "prefer_fused_kernel", "skips_on_found_inf"]

_FUSED_CAPABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# fp32 only: the engine's master weights are fp32 under bf16/fp16 compute; a model that keeps bf16
# parameters of its own gets the loop, whose rounding one-process PyTorch shares
_FUSED_DTYPES = (torch.float32,)


def prefer_fused_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Turn on ``fused=True`` in every parameter group of ``optimizer`` when it is exactly one of
    Adam, AdamW or SGD (without momentum), no group chose ``fused`` or ``foreach``, none is
    ``differentiable``, and every parameter is a dense fp32 tensor on a device with fused kernels.
    Returns whether it did."""
    if type(optimizer) not in _FUSED_CAPABLE:
        return False
    supported = set(_get_fused_kernels_supported_devices())
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") is not None:
            return False
        if group.get("differentiable", False):
            return False
        if isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0):
            return False  # see the module note: momentum buffers that start late
        for param in group["params"]:
            if (param.is_sparse or param.dtype not in _FUSED_DTYPES
                    or param.device.type not in supported):
                return False
    for group in optimizer.param_groups:
        group["fused"] = True  # not the defaults: a group added later is checked by nobody
    return True


def skips_on_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs PyTorch's fused kernel in every group, which reads the
    optimizer's ``found_inf`` attribute (a device tensor; 1 skips the update and undoes the step
    count, on the device: ``torch.amp.GradScaler``'s protocol with fused optimizers). Only exactly
    Adam, AdamW and SGD: their other kernels refuse ``found_inf``, a subclass may step otherwise.

    Example::

        skips_on_found_inf(torch.optim.AdamW(params, fused=True))   # True
    """
    return (type(optimizer) in _FUSED_CAPABLE
            and all(group.get("fused") for group in optimizer.param_groups))


def _group_kernel(group: dict[str, Any]) -> str:
    if "fused" not in group and "foreach" not in group:
        return "its own step"  # an optimizer without PyTorch's kernel choice
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:  # PyTorch decides at step time: foreach for CUDA tensors, else the loop
        tensors = [p for p in group["params"] if isinstance(p, torch.Tensor)]
        _, foreach = _default_to_fused_or_foreach(tensors, differentiable=bool(
            group.get("differentiable", False)), use_fused=False)
    return "foreach" if foreach else "for-loop"


def kernel_name(optimizer: torch.optim.Optimizer) -> str:
    """The kernel ``optimizer.step()`` runs, in words: ``"fused"``, ``"foreach"``, ``"for-loop"``
    (one small kernel per tensor), or several of them joined by ``" + "`` when the parameter
    groups differ. Read it after any :func:`prefer_fused_kernel`, so it records what ran.

    Example::

        kernel_name(torch.optim.AdamW(model.parameters()))   # "for-loop" on CPU
    """
    kinds = sorted({_group_kernel(group) for group in optimizer.param_groups})
    return " + ".join(kinds) if kinds else "for-loop"
