"""Reading a device scalar on the host without draining the device's queue.

[Note: the step's one host read] ``engine.step()`` returns whether it applied (an fp16 overflow
skips it) and sets ``last_grad_norm``: both need the gradient norm on the host. ``.item()`` on a CUDA
tensor waits for *everything* queued on the stream before it returns, so when the read comes before
the optimizer step (to decide whether to step at all), the GPU idles while the host then prepares
and launches the optimizer's kernels, and the next step's forward starts on an empty queue.

Instead the norm is copied to pinned host memory as soon as it is computed (a non-blocking copy,
then an event), the decision is left to the device (the clip coefficient is a device tensor; an
fp16 overflow reaches the fused optimizer kernel as its ``found_inf`` argument, which skips the
update, as ``torch.amp.GradScaler`` does with fused optimizers), the optimizer's kernels are queued,
and only then does the host wait, on the event: for the norm, not for the optimizer step, which
the device runs while the host goes on to the next step. On a CPU device there is no queue: the read
is the tensor's value.
"""

from __future__ import annotations

import torch

__all__ = ["DeferredRead", "defers_host_reads"]


class DeferredRead:
    """One device scalar, on its way to the host; :meth:`value` waits for it alone.

    Example::

        read = DeferredRead(total)      # right after `total` is computed
        optimizer.step()                # queued behind it
        norm = read.value() ** 0.5      # waits for `total`, not for the optimizer step
    """

    __slots__ = ("_event", "_host")

    def __init__(self, scalar: torch.Tensor) -> None:
        if scalar.numel() != 1:
            raise ValueError(f"DeferredRead takes one value; got shape {tuple(scalar.shape)}")
        if scalar.device.type == "cuda":
            self._host = torch.empty(scalar.shape, dtype=scalar.dtype, pin_memory=True)
            self._host.copy_(scalar, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._host = scalar
            self._event = None

    def value(self) -> float:
        """The scalar, once the device has computed it."""
        if self._event is not None:
            self._event.synchronize()
        return float(self._host.item())


def defers_host_reads(device: torch.device) -> bool:
    """Whether the step reads the gradient norm only after queueing the optimizer (see [Note: the
    step's one host read]): on a GPU. A CPU has no queue to keep full, and there the clip's skip when
    the norm is below ``max_norm`` saves a pass over the gradients. (The tests switch it on for CPU
    ranks, through the name :mod:`dspark.engine.engine` imports, to run the GPU's order of work.)"""
    return device.type == "cuda"
