"""Activation memory without running the model: a forward traced on fake tensors.

[Note: the fake trace] Where a measured step does not fit on the probe device (or when asked,
``dspark.plan(..., trace="fake")``), the planner estimates a step's activations from shapes alone.
Under :class:`torch._subclasses.fake_tensor.FakeTensorMode` every tensor carries a shape, dtype and
device and no data; the model's parameters and buffers are replaced by fake ones of the same shape
(:func:`torch.func.functional_call`: the caller's model is neither copied nor touched, a meta model
works alike), and the loss is computed from a fake copy of the sample batch at each batch size,
under the precision's autocast. A :func:`torch.autograd.graph.saved_tensors_hooks` pack hook sees
every tensor autograd keeps for backward; their storages, each counted once and parameters
excluded (they are model state), are the activations alive when backward starts, which is where a
training step's tensor peak sits. The loss's own graph is in it; what is not: scratch a kernel frees
before it returns, and the gradient of the largest activation, which backward allocates beside the
saved ones. The second is added (the largest saved storage: an upper bound on one activation's
gradient). Other scratch backward allocates beside the saved tensors is not seen: against the
probe's measurement on this CPU, the gpt2-cpu preset's trace came out about a tenth low (fp32 and
bf16), a 256-wide MLP's within a few percent in fp32 but at half in bf16, where such scratch
outweighs its narrow activations. No time is measured: the plan's compute
and optimizer columns read 0 on this path.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from dspark.planner.probe import Line, Probe, loss_of, slice_batch
from dspark.policy.strategies import precision_policy

__all__ = ["fake_activation_bytes", "fake_probe"]


def _storage_id(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def fake_activation_bytes(model: nn.Module, sample_batch: Any, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                          precision: str, device: torch.device, rows: int) -> int:
    """Bytes a training step's activations hold on ``device`` at ``rows`` samples, from one forward
    on fake tensors (see [Note: the fake trace]). ``model`` may be on any device, meta included.

    Example::

        fake_activation_bytes(model, (x, y), loss_fn=F.cross_entropy, precision="fp32",
                              device=torch.device("cpu"), rows=64)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    batch = slice_batch(tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, sample_batch), rows)
    dtype = precision_policy(precision).compute_dtype
    named = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes: dict[str, torch.Tensor] = {}
        by_id: dict[int, torch.Tensor] = {}
        for name, t in named.items():  # tied weights stay tied: one fake per real tensor
            if id(t) not in by_id:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                by_id[id(t)] = fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake
            fakes[name] = by_id[id(t)]
        state = {_storage_id(t) for t in fakes.values()}
        fake_batch = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                              if isinstance(t, torch.Tensor) else t, batch)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage_id(t)
            if key not in state:
                saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
            return t

        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            loss_of(lambda *a, **k: functional_call(model, fakes, a, k, tie_weights=False), fake_batch, loss_fn)
        del mode
    return sum(saved.values()) + max(saved.values(), default=0)


def fake_probe(model: nn.Module, sample_batch: Any, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
               precision: str, device: torch.device, batches: tuple[int, int], unit_bytes: list[int],
               optimizer_state: tuple[int, bool]) -> Probe:
    """A :class:`dspark.planner.Probe` from fake traces at the two batch sizes (see [Note: the fake
    trace]): activations as measured would be, no time; gradients ready evenly through backward in
    reverse parameter order and each zero3 unit's share of forward by its bytes, as
    :meth:`Probe.from_one_step` assumes.

    Example::

        fake_probe(model, (x, y), loss_fn=F.cross_entropy, precision="bf16", device=torch.device("cpu"),
                   batches=(2, 8), unit_bytes=[1, 4], optimizer_state=(2, True))
    """
    points = [(rows, float(fake_activation_bytes(model, sample_batch, loss_fn=loss_fn, precision=precision,
                                                 device=device, rows=rows))) for rows in dict.fromkeys(batches)]
    gc.collect()  # the traces' fake tensors: nothing may count them as held memory
    (b0, y0), (b1, y1) = points[0], points[-1]
    per_sample = (y1 - y0) / (b1 - b0) if b1 != b0 else y1 / b1
    shape = Probe.from_one_step(device=f"fake:{device}", batch=1, forward_ms=0.0, backward_ms=0.0,
                                optimizer_ms=0.0, step_bytes=0.0,
                                num_params=len(list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))),
                                unit_bytes=unit_bytes, optimizer_state=optimizer_state)
    return Probe(device=shape.device, batches=batches, forward_ms=shape.forward_ms, backward_ms=shape.backward_ms,
                 optimizer_ms=0.0, step_bytes=Line(fixed=max(0.0, y1 - per_sample * b1), per_sample=per_sample),
                 grad_ready=shape.grad_ready, unit_forward_share=shape.unit_forward_share,
                 optimizer_state=optimizer_state)
