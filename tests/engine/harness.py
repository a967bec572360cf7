"""Rank functions shared by the engine tests: train a case (``tests/engine/cases.py``) with the engine on
this rank's slice of each global batch; the same training in plain single-process PyTorch on the whole
batch (autocast + GradScaler for mixed precision), or under PyTorch's DDP on the same slices; and the
comparisons of the states they end with."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import dspark
from dspark import comm
from dspark.engine import LossScaler
from tests.engine.cases import EVAL_STEP, Batch, Forward, get_case
from tests.engine.cases import GLOBAL_BATCH as GLOBAL_BATCH  # re-exported for tests/checkpoint

LR = 1e-2
SGD_LR = 0.2
"""Plain SGD without momentum: the update is lr * gradient, so a wrong factor on the gradient (1/N,
1/grad_accum_steps, 1/loss scale) moves every parameter by a visible amount. At 0.2 the tiny models'
parameters move by about 1e-2 relative per step, a thousand times the fp32 tolerance below."""
OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=LR),
    "sgd": functools.partial(torch.optim.SGD, lr=SGD_LR),
    # SGD with every gradient halved, as a wrong 1/N on 2 ranks would make it: only to show that the
    # SGD parity tests would see such a bug
    "sgd_halved_gradient": functools.partial(torch.optim.SGD, lr=SGD_LR / 2),
}
RTOL = 1e-5
"""fp32: two ranks sum gradients in another order than one process; 3 steps stay within ~1e-6."""
ATOL = 1e-6
"""The norm floor. Some tensors get a gradient that is zero in exact arithmetic but not in floats
(the attention key bias: softmax ignores a constant added to a row of scores; parameters that start
at zero and get cancelling contributions). Such a tensor is rounding noise on both sides, so its
relative error means nothing; its absolute difference is bounded by fp32 rounding of the gradient
sums, ~1e-7 per element per step at these sizes (measured below 2e-7 over 3 SGD steps of BERT and
GPT-2). A wrong factor moves real parameters by >= 1e-3."""
ATOL_ADAMW = 5e-5
"""AdamW divides by the root of the squared gradient, so a rounding-noise gradient of the size of its
eps (1e-8) becomes an update of up to lr per step: GPT-2's key bias then differs by up to 9e-6
between one process on the whole batch and the same process on 2 or 4 pieces of it (measured). A
gradient routed to the wrong rows moves an element by lr = 1e-2 per step."""

_COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def micro_batches(batch: Batch, accum: int) -> list[Batch]:
    """``accum`` equal micro-batches of a global batch, in order."""
    return list(zip(*(t.chunk(accum) for t in batch), strict=True))


def autocast_forward(model: nn.Module, precision: str) -> Forward:
    """The model's forward under ``torch.autocast`` for bf16/fp16 (as a user's own loop runs it)."""
    dtype = _COMPUTE_DTYPES[precision]
    if dtype is None:
        return model

    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type="cpu", dtype=dtype):
            return model(*args, **kwargs)
    return forward


@contextlib.contextmanager
def evaluation(module: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd, as a validation loop runs; back to training mode after."""
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train()


def train_reference(case_name: str, steps: int, *, optimizer: str = "adamw", accum: int = 1,
                    clip: float | None = None, precision: str = "fp32",
                    split: int = 1) -> dict[str, Any]:
    """Plain PyTorch, one process, the whole global batch (in ``accum * split`` equal pieces whose
    gradients add up: ``split`` > 1 measures how much the batch split alone changes the result)."""
    case = get_case(case_name)
    model = case.build()
    opt = OPTIMIZERS[optimizer](model.parameters())
    defaults = LossScaler()
    scaler = (torch.amp.GradScaler("cpu", init_scale=defaults.scale, growth_interval=defaults.growth_interval)
              if precision == "fp16" else None)
    forward = autocast_forward(model, precision)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        for micro in micro_batches(case.batch(step), accum * split):
            loss = case.loss(forward, micro) / (accum * split)
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if scaler is None:
            opt.step()
        else:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < before:
                raise AssertionError(f"reference step {step} overflowed in fp16: the test needs every step")
    with evaluation(model):
        evaluated = case.evaluate(autocast_forward(model, precision), case.batch(EVAL_STEP))
    return {"state": _clone_state(model), "norms": norms, "eval": evaluated.float()}


def build_engine(case_name: str, strategy: str, *, optimizer: str = "adamw", accum: int = 1,
                 clip: float | None = None, precision: str = "fp32", bucket_mb: float = 1e-4,
                 **engine_kwargs: Any) -> dspark.Engine:
    return dspark.Engine(get_case(case_name).build(), optimizer=OPTIMIZERS[optimizer], strategy=strategy,
                         precision=precision, grad_accum_steps=accum, clip_grad_norm=clip,
                         bucket_mb=bucket_mb, **engine_kwargs)


def train_steps(engine: dspark.Engine, case_name: str, steps: range) -> list[float | None]:
    """Train ``engine`` on this rank's slice of each step's (micro-)batches; ``last_grad_norm`` per step."""
    case = get_case(case_name)
    norms = []
    for step in steps:
        # micro-batches: each micro-step takes 1/accum of the global batch, split across ranks
        for micro in micro_batches(case.batch(step), engine.grad_accum_steps):
            engine.backward(case.loss(engine, dspark.distribute_batch(micro, shard_dim=0)))
        if not engine.step():
            raise AssertionError(f"engine step {step} was skipped (fp16 overflow): the test needs every step")
        norms.append(engine.last_grad_norm)
    return norms


def evaluate_engine(engine: dspark.Engine, case_name: str) -> torch.Tensor:
    """The engine's output on a whole unseen batch, in eval mode under no_grad (every rank the same
    batch: evaluation must not depend on which rank is asked)."""
    case = get_case(case_name)
    with evaluation(engine.module):
        return case.evaluate(engine, case.batch(EVAL_STEP)).float()


def train_engine(case_name: str, strategy: str, steps: int, *, evaluate: bool = False,
                 **kwargs: Any) -> dict[str, Any]:
    """Train with the engine (:func:`build_engine` takes ``kwargs``); return the full state (and the
    eval output) with what the engine measured."""
    engine = build_engine(case_name, strategy, **kwargs)
    comm.reset_stats()
    norms = train_steps(engine, case_name, range(steps))
    stats = {k: (v.calls, v.bytes) for k, v in comm.stats().items()}
    local = _clone_buffers(engine.module)  # before full_state_dict, which gives rank 0's
    out = {"state": engine.full_state_dict(), "memory": engine.memory_report(), "stats": stats,
           "norms": norms, "local_buffers": local}
    if evaluate:
        out["eval"] = evaluate_engine(engine, case_name)
    engine.close()
    return out


def train_ddp(case_name: str, steps: int, *, optimizer: str = "sgd") -> dict[str, Any]:
    """PyTorch's DistributedDataParallel (defaults: rank 0's buffers broadcast before every forward) on
    the same slices as :func:`train_engine`; this rank's module state at the end, and its eval output
    on a whole unseen batch. Rank 0's state is what a DDP user checkpoints."""
    from torch.nn.parallel import DistributedDataParallel

    case = get_case(case_name)
    ddp = DistributedDataParallel(case.build())
    opt = OPTIMIZERS[optimizer](ddp.parameters())
    for step in range(steps):
        opt.zero_grad()
        case.loss(ddp, dspark.distribute_batch(case.batch(step), shard_dim=0)).backward()
        opt.step()
    local = _clone_buffers(ddp.module)
    with evaluation(ddp.module):  # the module alone: DDP's forward would broadcast rank 0's buffers
        evaluated = case.evaluate(ddp.module, case.batch(EVAL_STEP)).float()
    state = _clone_state(ddp.module)
    del ddp, opt
    return {"state": state, "eval": evaluated, "local_buffers": local}


def _clone_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's own buffers as they are: no collective, so ranks may differ."""
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def _clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_state(name: str, strategy: str, steps: int, *, precision: str = "fp32", accum: int = 1,
                 clip: float | None = None, bucket_mb: float = 1e-4, **engine_kwargs: Any) -> dict[str, Any]:
    """AdamW training with the engine (the original parity harness's contract)."""
    return train_engine(name, strategy, steps, optimizer="adamw", precision=precision, accum=accum,
                        clip=clip, bucket_mb=bucket_mb, **engine_kwargs)


def reference_state(name: str, steps: int, *, accum: int = 1, clip: float | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch AdamW, one process, the whole global batch."""
    return train_reference(name, steps, accum=accum, clip=clip)["state"]  # type: ignore[no-any-return]


def rel_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ||a - b|| / ||b|| over the tensors of two state dicts (same keys)."""
    if a.keys() != b.keys():
        raise AssertionError(f"state dict keys differ: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12))
               for k in b)


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, rtol: float = RTOL,
               atol: float = ATOL) -> list[str]:
    """The tensors where ||got - want|| > rtol * ||want|| + atol, each described with its numbers
    (worst first); a missing or extra key or another shape is a mismatch too."""
    if got.keys() != want.keys():
        return [f"keys differ: {sorted(got.keys() ^ want.keys())}"]
    found = []
    for key in want:
        a, b = got[key], want[key]
        if a.shape != b.shape:
            found.append((math.inf, f"{key}: shape {tuple(a.shape)} != {tuple(b.shape)}"))
            continue
        diff = float((a.double() - b.double()).norm())
        size = float(b.double().norm())
        if not diff <= rtol * size + atol:  # also catches NaN
            found.append((diff / (size + atol), f"{key}: ||got - want|| = {diff:.3g}, ||want|| = {size:.3g} "
                                                f"(relative {diff / max(size, 1e-30):.2g})"))
    return [text for _, text in sorted(found, key=lambda item: -item[0])]


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, *,
                 rtol: float = RTOL, atol: float = ATOL) -> None:
    """Fail with every tensor outside ``rtol * ||want|| + atol``, named, and what was compared."""
    wrong = mismatches(got, want, rtol=rtol, atol=atol)
    if wrong:
        shown = "\n  ".join(wrong[:8]) + (f"\n  ... {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise AssertionError(f"{what}: {len(wrong)} of {len(want)} tensors differ beyond rtol={rtol:g}, "
                             f"atol={atol:g}:\n  {shown}")


def parity(name: str, strategy: str, steps: int = 3, **kwargs: Any) -> dict[str, Any]:
    """Engine (2 ranks) against one process, AdamW; the largest relative error and what the engine saw."""
    ref = train_reference(name, steps, accum=kwargs.get("accum", 1), clip=kwargs.get("clip"))
    got = engine_state(name, strategy, steps, **kwargs)
    return {"error": rel_error(got["state"], ref["state"]), "stats": got["stats"], "memory": got["memory"],
            "norms": got["norms"]}


def run_or_explain_hang(pool: Any, fn: Any, *args: Any, timeout_s: float, hang_means: str, **kwargs: Any) -> list[Any]:
    """``pool.run`` with a short timeout; a rank that never finishes (stuck in a collective its peer
    never joins) fails the test with ``hang_means`` (what the ranks disagreed about) instead of waiting
    for the process group's timeout. The pool restarts after a hang."""
    try:
        return pool.run(fn, *args, timeout=timeout_s, **kwargs)  # type: ignore[no-any-return]
    except AssertionError as exc:
        if "did not finish" not in str(exc):
            raise
        raise AssertionError(f"{exc}: {hang_means}") from None


def with_deferred_host_reads(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run rank function ``fn`` with ``engine.step()`` in a GPU's order of work on these CPU ranks
    (the gradient norm read after the optimizer's kernels are queued, the clip coefficient on the
    device, an fp16 overflow skipped by the fused kernel's ``found_inf``): see
    :func:`dspark.engine.engine.defers_host_reads`."""
    from dspark.engine import engine as engine_module

    original = engine_module.defers_host_reads
    engine_module.defers_host_reads = lambda device: True
    try:
        return fn(*args, **kwargs)
    finally:
        engine_module.defers_host_reads = original
