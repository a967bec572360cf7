"""Scaling the reduced gradients and finding a non-finite one in the same pass.

[Note: non-finite gradients found in the reduction] A NaN or an infinity in one rank's gradient
reaches every rank through the reduction (a sum holding one is not finite) and one optimizer step
with it makes the parameters NaN for good, whatever the loss said: an ``inf`` in one rank's input
through ``tanh`` gives a finite loss and infinite gradients. The reducer already passes over every
reduced gradient once, to scale the sum into the window's mean (``1/N``, the weights, fp16's
``1/loss_scale``); :func:`scale_and_check` makes that pass PyTorch's fused unscale-and-check kernel
(``torch.amp.GradScaler``'s), which multiplies and sets a one-element flag when it meets a value
that is not finite, at the cost of the multiplication alone. The flag stays on the device:

* replicate and zero1 reduce whole gradients, equal on every rank, so every rank's flag is the same;
* zero2 and zero3 reduce shards, so :class:`dspark.engine.update.Update` all-reduces the flag (one
  element) before the step, unless the step measures the global norm anyway (``clip_grad_norm``),
  whose all-reduce already carries a non-finite value to every rank;
* one rank (nothing reduced) scales its gradients the same way.

fp16's overflow check is this flag too: dynamic loss scaling needs exactly "some gradient is not
finite", so the step no longer measures the gradient norm for it. See [Note: non-finite steps] in
:mod:`dspark.engine.update` for what the step does with the flag.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["new_flag", "scale_and_check"]


def new_flag(device: torch.device) -> torch.Tensor:
    """A cleared non-finite flag: one float32 element on ``device`` (the fused kernel's ``found_inf``)."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def scale_and_check(tensors: Sequence[torch.Tensor], factor: float, found_inf: torch.Tensor | None) -> None:
    """``tensors *= factor`` in place; with ``found_inf``, in the same pass, ``found_inf`` becomes 1
    when any element is not finite (it is never cleared here: one flag gathers a whole step). Without
    a flag and with ``factor == 1`` nothing is touched.

    Example::

        flag = new_flag(torch.device("cpu"))
        scale_and_check([grads], 0.5, flag)   # grads halved; flag[0] == 1.0 if grads held inf/nan
    """
    if not tensors:
        return
    if found_inf is None:
        if factor != 1.0:
            torch._foreach_mul_(list(tensors), factor)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    inv_scale = torch.full((1,), factor, dtype=torch.float32, device=found_inf.device)
    for dtype, group in by_dtype.items():  # the fused kernel takes one dtype at a time on CUDA
        if dtype == torch.float64 and factor != 1.0:
            # its factor is a float32: check unscaled, then scale with the float64 factor a plain
            # multiplication uses (float64 gradients are rare; the others round the factor alike)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, torch.ones_like(inv_scale))
            torch._foreach_mul_(group, factor)
            continue
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
