"""Rank functions shared by the engine tests: train with the engine on this rank's slice of a fixed
global batch, and the same training in plain single-process PyTorch on the whole batch."""

from __future__ import annotations

import functools
from typing import Any

import torch

import dspark
from dspark import comm
from tests.engine import tiny_models as tm

GLOBAL_BATCH = 8
LR = 1e-2


def reference_state(name: str, steps: int, *, accum: int = 1, clip: float | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, the whole global batch."""
    model = tm.make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = tm.batch(name, GLOBAL_BATCH, step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(accum), y.chunk(accum), strict=True):
            (tm.loss_fn(name, model(xs), ys) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_state(name: str, strategy: str, steps: int, *, precision: str = "fp32", accum: int = 1,
                 clip: float | None = None, bucket_mb: float = 1e-4, **engine_kwargs: Any) -> dict[str, Any]:
    """Train with the engine on this rank's slice; return the full state and what it measured."""
    engine = dspark.Engine(tm.make(name), optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                           strategy=strategy, precision=precision, grad_accum_steps=accum,
                           clip_grad_norm=clip, bucket_mb=bucket_mb, **engine_kwargs)
    comm.reset_stats()
    norms = []
    for step in range(steps):
        x, y = tm.batch(name, GLOBAL_BATCH, step)
        # micro-batches: each micro-step takes 1/accum of the global batch, split across ranks
        for xs, ys in zip(x.chunk(accum), y.chunk(accum), strict=True):
            xl, yl = dspark.distribute_batch((xs, ys), shard_dim=0)
            engine.backward(tm.loss_fn(name, engine(xl), yl))
        assert engine.step()
        norms.append(engine.last_grad_norm)
    stats = {k: (v.calls, v.bytes) for k, v in comm.stats().items()}
    out = {"state": engine.full_state_dict(), "memory": engine.memory_report(), "stats": stats,
           "norms": norms}
    engine.close()
    return out


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ||a - b|| / ||b|| over the tensors of two state dicts (same keys)."""
    if a.keys() != b.keys():
        raise AssertionError(f"state dict keys differ: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12))
               for k in b)


def parity(name: str, strategy: str, steps: int = 3, **kwargs: Any) -> dict[str, Any]:
    ref = reference_state(name, steps, accum=kwargs.get("accum", 1), clip=kwargs.get("clip"))
    got = engine_state(name, strategy, steps, **kwargs)
    return {"error": rel_error(got["state"], ref), "stats": got["stats"], "memory": got["memory"],
            "norms": got["norms"]}
