"""The engine's checks of what the user passed: the arguments, that every rank built the same model
and optimizer, a backward's weight, and warnings for settings that run but surprise (emulated bf16,
an optimizer option nobody reads). Each names the value it refuses and the fix."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from dspark import comm
from dspark.engine.param_slot import ParamSlot

__all__ = ["check_max_norm", "check_model_and_optimizer", "check_no_sync_batchnorm_on_cpu",
           "check_same_model_on_every_rank", "check_same_optimizer_on_every_rank", "check_weight",
           "unique_params", "warn_emulated_bf16", "warn_unknown_group_options"]


def unique_params(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """``(names, param)`` for every distinct parameter, in ``named_parameters()`` order (tied ones list
    every name)."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [(names[k], params[k]) for k in params]


def _first_difference(what: str, everyone: list[dict[str, Any]], rank: int, fix: str) -> None:
    """Raise ``ValueError`` naming the first key whose value differs from rank 0's."""
    for other, theirs in enumerate(everyone[1:], start=1):
        for key in dict.fromkeys([*everyone[0], *theirs]):
            a, b = everyone[0].get(key, "(not set)"), theirs.get(key, "(not set)")
            if a != b:
                raise ValueError(f"rank {rank}: {what} differ between ranks: {key}={a!r} on rank 0 but "
                                 f"{b!r} on rank {other}. {fix}")


def warn_emulated_bf16() -> None:
    """bf16 on a CPU without native bf16 instructions (AVX2 only: no AVX512-BF16, no AMX) runs
    emulated, many times slower than fp32 (``dspark.bench.measure.cpu_precision.cpu_matmul_ms`` times both),
    so a step looks hung. Said once, on rank 0."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return  # this PyTorch cannot tell: say nothing rather than guess
    if not native:
        warnings.warn(
            f"precision='bf16' on a CPU without native bf16 instructions (capability "
            f"{torch.backends.cpu.get_cpu_capability()}, no AVX512-BF16 or AMX): PyTorch emulates "
            "it, and its matmuls can run 10-40x slower than fp32. Pass precision='fp32' on this "
            "machine (dspark bench does so for its CPU presets).", stacklevel=3)


def warn_unknown_group_options(optimizer: torch.optim.Optimizer,
                                groups: list[tuple[dict[str, Any], list[int]]],
                                slots: list[ParamSlot]) -> None:
    """A ``param_groups`` override the optimizer has no option for (``{"lrr": 0.1}``) is kept in
    its group and read by nobody, as PyTorch does; a typo there silently trains with the default,
    so it is named once (a key of the user's own, read by their scheduler, is still allowed)."""
    known = set(optimizer.defaults)
    for overrides, indices in groups:
        unknown = sorted(k for k in overrides if k not in known)
        if unknown:
            names = [slots[i].name for i in indices[:3]]
            warnings.warn(
                f"param_groups gave {', '.join(map(repr, unknown))} to {', '.join(names)}"
                f"{' ...' if len(indices) > 3 else ''}, which {type(optimizer).__name__} has no "
                f"option for (its options: {', '.join(sorted(known))}); the value is kept in the "
                "group but the optimizer does not read it. A typo?", stacklevel=4)


def check_same_optimizer_on_every_rank(optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Every rank's factory built the same optimizer: class, group count and each group's options
    (a learning rate read from a per-rank config would make replicas drift apart silently)."""
    mine: dict[str, Any] = {"optimizer": type(optimizer).__name__, "groups": len(optimizer.param_groups)}
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                # other objects by type alone: their repr may hold a per-process address
                mine[f"param_groups[{i}][{key!r}]"] = (value.tolist() if isinstance(value, torch.Tensor)
                                                       else value if isinstance(value, (int, float, str, bool,
                                                                                       type(None), tuple))
                                                       else f"<{type(value).__name__}>")
    _first_difference("the optimizers", comm.all_gather_object(mine, label="dspark.same_optimizer"), rank,
                      "Build the optimizer with the same options on every rank")


def check_same_model_on_every_rank(model: nn.Module, rank: int, settings: dict[str, Any]) -> None:
    """Every rank passed the same engine ``settings`` and built the same model: parameters (name,
    shape, dtype, requires_grad) and buffers (name, shape, dtype). A mismatch names the first
    difference instead of hanging, or training diverged replicas, later. One collective."""
    mine = [("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
            for name, p in model.named_parameters()]
    mine += [("buffer", name, tuple(b.shape), str(b.dtype), False) for name, b in model.named_buffers()]
    gathered = comm.all_gather_object((settings, mine), label="dspark.same_model")
    _first_difference("the dspark.Engine arguments", [g[0] for g in gathered], rank,
                      "Pass the same arguments on every rank")
    everyone = [g[1] for g in gathered]
    reference = everyone[0]
    for other, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else None
            b = theirs[i] if i < len(theirs) else None
            if a != b:
                def fmt(entry: Any) -> str:
                    if entry is None:
                        return "nothing"
                    kind, name, shape, dtype, grad = entry
                    req = ", requires_grad" if grad else (", frozen" if kind == "parameter" else "")
                    return f"{kind} {name} {shape} {dtype}{req}"
                raise ValueError(
                    f"rank {rank}: the model differs between ranks, so data-parallel training cannot "
                    f"start: entry #{i} is {fmt(a)} on rank 0 but {fmt(b)} on rank {other}. Build the "
                    "same model on every rank (and freeze the same parameters)")


def check_weight(weight: float | int | torch.Tensor | None) -> float | None:
    if weight is None:
        return None
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise ValueError(f"weight must be a number or a one-element tensor, got shape {tuple(weight.shape)}")
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"weight={weight!r} must be a finite number >= 0 (the samples or tokens this "
                         "rank's loss averages over)")
    return float(weight)


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """The engine's two inputs beside its options (:class:`dspark.EngineConfig` checks those): a
    module, and a factory that builds the optimizer over the tensors the engine gives it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise TypeError(
            f"optimizer must be a factory that takes the parameters and returns an optimizer, e.g. "
            f"functools.partial(torch.optim.AdamW, lr=3e-4); got {type(optimizer).__name__} (the "
            f"engine decides which tensors the optimizer updates: whole parameters or shards)")


def check_no_sync_batchnorm_on_cpu(model: nn.Module, device: torch.device) -> None:
    """``nn.SyncBatchNorm`` refuses CPU tensors in its forward: say so at construction, with the fix."""
    if device.type != "cpu":
        return
    first = next((name for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)), None)
    if first is not None:
        raise ValueError(
            f"{'module ' + repr(first) if first else 'the model'} is an nn.SyncBatchNorm, which trains on "
            "GPUs only (its forward "
            "refuses CPU tensors): on CPU ranks keep the model's plain BatchNorm layers (leave out "
            "nn.SyncBatchNorm.convert_sync_batchnorm) and pass sync_batchnorm=True to dspark.Engine "
            "for statistics over the global batch")


def check_max_norm(max_norm: Any) -> None:
    """``engine.clip_grad_norm_``'s ``max_norm``: a positive number (``float("inf")`` only measures)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be a positive number (float('inf') only "
                         "measures the norm)")
