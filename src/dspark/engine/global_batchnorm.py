"""BatchNorm with statistics over the global batch, on any backend: ``Engine(sync_batchnorm=True)``.

[Note: global batch statistics] In training mode a BatchNorm layer normalises with the statistics of
the batch it sees. Under data parallelism each rank sees 1/N of it, so its statistics (and so the
gradients and running averages) differ from one process on the whole batch: PyTorch's DDP keeps that
behaviour, and its ``SyncBatchNorm`` fixes it only on CUDA. Here each rank computes, per channel, its
sample count, mean and sum of squared deviations; one all-gather combines them exactly (Chan's
parallel-variance rule, no ``E[x^2] - E[x]^2`` cancellation) into the global mean and variance. Backward
needs two more global sums per channel (of the output gradient, and of it times the normalised input),
one all-reduce.

Scaling: each rank's loss is the mean over its own samples and the engine averages gradients over
ranks, so the gradient each rank returns for its inputs is N times its share of the global one, and the
engine's 1/N restores it; the layer's own weight and bias gradients are plain local sums. Both assume
equal local batches, which is what the engine checks when no ``weight=`` is given.

The layers keep their class (a subclass is swapped in), parameters, buffers and state-dict keys; the
running statistics come out identical on every rank, so no broadcast is needed for them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dspark import comm

__all__ = ["GlobalBatchNormMixin", "convert_batchnorm", "restore_batchnorm"]


class _GlobalBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, stats_out: list[torch.Tensor]) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        count = xf.numel() // xf.shape[1]
        mean = xf.mean(dims) if count else xf.new_zeros(xf.shape[1])
        m2 = (xf - mean.view(1, -1, *([1] * (x.dim() - 2)))).square().sum(dims)
        local = torch.cat([torch.tensor([float(count)], device=x.device), mean, m2])
        everyone = torch.stack(comm.all_gather(local, label="dspark.sync_batchnorm.all_gather"))  # (N, 1 + 2C)
        counts, means, m2s = everyone[:, :1], everyone[:, 1: 1 + mean.numel()], everyone[:, 1 + mean.numel():]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"global batch norm over {int(total)} value(s) per channel: training needs "
                             "more than one")
        g_mean = (counts * means).sum(0) / total
        g_m2 = (m2s + counts * (means - g_mean).square()).sum(0)
        var = g_m2 / total
        invstd = torch.rsqrt(var + eps)
        shape = (1, -1, *([1] * (x.dim() - 2)))
        xhat = (xf - g_mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.float().view(shape)
        if bias is not None:
            y = y + bias.float().view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total = float(total)
        ctx.param_dtype = (weight if weight is not None else bias if bias is not None else x).dtype
        stats_out.extend([g_mean, var * (total / (total - 1))])
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, xhat.dim())]
        shape = (1, -1, *([1] * (xhat.dim() - 2)))
        g = grad_out.float()
        sum_g = g.sum(dims)
        sum_gx = (g * xhat).sum(dims)
        sums = torch.cat([sum_g, sum_gx])
        comm.all_reduce(sums, label="dspark.sync_batchnorm.all_reduce")
        c = sum_g.numel()
        mean_g, mean_gx = sums[:c] / ctx.total, sums[c:] / ctx.total
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = scale.view(shape) * (g - mean_g.view(shape) - xhat * mean_gx.view(shape))
        grad_w = sum_gx.to(ctx.param_dtype) if ctx.needs_input_grad[1] else None
        grad_b = sum_g.to(ctx.param_dtype) if ctx.needs_input_grad[2] else None
        return grad_x.to(grad_out.dtype), grad_w, grad_b, None, None


class GlobalBatchNormMixin:
    """Swapped in front of a ``_BatchNorm`` class: training-mode statistics over the global batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn: Any = self
        if not (bn.training or not bn.track_running_stats):
            return super().forward(x)  # type: ignore[misc]
        bn._check_input_dim(x)
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                momentum = 1.0 / float(bn.num_batches_tracked)
        stats: list[torch.Tensor] = []
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = _GlobalBatchNormFn.apply(x, bn.weight, bn.bias, bn.eps, stats)
        if bn.training and bn.track_running_stats and bn.running_mean is not None:
            with torch.no_grad():
                mean, unbiased = stats
                bn.running_mean.mul_(1 - momentum).add_(mean.to(bn.running_mean.dtype), alpha=momentum)
                bn.running_var.mul_(1 - momentum).add_(unbiased.to(bn.running_var.dtype), alpha=momentum)
        return y


_SWAPPED: dict[type, type] = {}


def convert_batchnorm(root: nn.Module) -> list[nn.Module]:
    """Make every BatchNorm layer under ``root`` normalise with global statistics (in place); returns
    the layers converted. A rank with a plain ``F.batch_norm`` call elsewhere is not affected.

    Example::

        convert_batchnorm(resnet)   # [BatchNorm2d(64), ...]
    """
    converted: list[nn.Module] = []
    for module in root.modules():
        cls = type(module)
        if not isinstance(module, nn.modules.batchnorm._BatchNorm) or isinstance(module, GlobalBatchNormMixin):
            continue
        if isinstance(module, nn.SyncBatchNorm):
            raise ValueError("sync_batchnorm=True replaces nn.SyncBatchNorm's CUDA-only path; build the "
                             "model with plain BatchNorm layers")
        if cls not in _SWAPPED:
            _SWAPPED[cls] = type(f"Global{cls.__name__}", (GlobalBatchNormMixin, cls), {})
        module.__class__ = _SWAPPED[cls]
        converted.append(module)
    return converted


def restore_batchnorm(modules: list[nn.Module]) -> None:
    """Undo :func:`convert_batchnorm` on ``modules``."""
    for module in modules:
        if isinstance(module, GlobalBatchNormMixin):
            module.__class__ = type(module).__mro__[2]
