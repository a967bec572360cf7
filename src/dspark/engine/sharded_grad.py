"""zero2/zero3: the module's parameters refuse to be read or scaled as gradients the engine holds in
shards, instead of clipping nothing.

[Note: a clip of the module's parameters] DDP's loop clips with
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` between the last backward and the step.
After the window's reduction a module parameter's ``.grad`` is, per strategy:

- replicate, zero1: the whole reduced gradient, in its bucket; the optimizer reads it (replicate) or
  a view of this rank's rows of it (zero1). PyTorch's clip measures the norm every process would and
  scales in place what the optimizer reads: the kept line is honoured exactly (a parity test against
  one process holds it to that).
- zero2, zero3: nothing, in plain PyTorch terms. Each rank keeps only its rows of each gradient,
  inside the engine, so PyTorch's clip would see no gradient, return 0 and clip nothing, and the run
  would train unclipped without a word.

Honouring it under zero2/zero3 would need the global norm, a collective, hidden inside an operation
on a tensor (the norm of ``p.grad``) that a loop may run on one rank alone (a log under ``if
master_process:``): that rank would wait in it, or pair it with another collective. So between the
window's reduction and ``step()`` each parameter's ``.grad`` is a :class:`ShardedGrad`: a tensor
with the parameter's shape, dtype and device and no storage, which answers ``is not None``,
``.shape``, ``.dtype`` and ``.device`` as a gradient would and raises
:class:`dspark.errors.ShardedGradError` at any operation on it, naming the parameter and the fix
(``Engine(clip_grad_norm=c)``, or ``engine.clip_grad_norm_(c)`` in the loop, which measure the norm
over every rank's rows as one process does). ``step()`` (or a failure) sets ``.grad`` back to None.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dspark.engine.param_slot import ParamSlot
from dspark.errors import ShardedGradError

__all__ = ["ShardedGrad", "ShardedGradMarks"]


class ShardedGrad(torch.Tensor):
    """Stands as a module parameter's ``.grad`` under zero2/zero3 (see [Note: a clip of the module's
    parameters]): shaped like the parameter, no storage, any operation raises.

    Example::

        param.grad = ShardedGrad(param, name="fc.weight", strategy="zero2", rank=0)
        torch.nn.utils.clip_grad_norm_([param], 1.0)   # ShardedGradError naming fc.weight
    """

    param_name: str
    strategy: str
    rank: int

    @staticmethod
    def __new__(cls, param: torch.Tensor, *, name: str, strategy: str, rank: int) -> ShardedGrad:
        grad = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype,  # type: ignore[attr-defined]
                                                   device=param.device)
        grad.param_name, grad.strategy, grad.rank = name, strategy, rank
        return grad  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ShardedGrad({self.param_name!r}, strategy={self.strategy!r})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") == "__get__":  # .shape, .dtype, .device, .grad_fn: no data read
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise _refusal(getattr(func, "__name__", str(func)), args)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _refusal(str(func), args)  # reached only from C++ (no torch function on the way)


def _marks(args: Any) -> Iterator[ShardedGrad]:
    for arg in args:
        if isinstance(arg, ShardedGrad):
            yield arg
        elif isinstance(arg, list | tuple):
            yield from _marks(arg)


def _refusal(op: str, args: Any) -> ShardedGradError:
    found = list(_marks(args))
    first = found[0] if found else None
    names = ", ".join(g.param_name for g in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    strategy = first.strategy if first is not None else "zero2"
    rank = first.rank if first is not None else 0
    return ShardedGradError(
        f"rank {rank}: {op}() on the gradient of {names or 'a parameter'} of a module trained with "
        f"strategy={strategy!r}: each rank holds only its rows of each gradient, inside the engine, so "
        "the module's parameters hold none to read or scale, and torch.nn.utils.clip_grad_norm_("
        "model.parameters(), c) (a line kept from DDP) would clip nothing. Clip with "
        "dspark.Engine(..., clip_grad_norm=c), or with norm = engine.clip_grad_norm_(c) between the "
        "window's last engine.backward() and engine.step(): the global norm over every rank's rows, "
        "as one process computes it (engine.last_grad_norm keeps it). Under replicate and zero1 the "
        "module's parameters hold the whole reduced gradient and PyTorch's clip works on them")


class ShardedGradMarks:
    """The :class:`ShardedGrad` of each parameter of ``slots``, made once and set as its ``.grad``
    each time the window is reduced under zero2/zero3 (made again only when the parameter's shape
    changed, as zero3's does between freed and gathered).

    Example::

        marks = ShardedGradMarks(slots, strategy="zero2", rank=0)
        marks.install()        # after the reduction; step() sets .grad back to None
    """

    def __init__(self, slots: Sequence[ParamSlot], *, strategy: str, rank: int) -> None:
        self.slots = list(slots)
        self.strategy = strategy
        self.rank = rank
        self._made: dict[int, tuple[torch.Size, ShardedGrad]] = {}

    def install(self) -> None:
        for slot in self.slots:
            param = slot.param
            shape = param.shape
            made = self._made.get(id(slot))
            if made is None or made[0] != shape:  # the stand-in's own .shape would go through its hook
                made = self._made[id(slot)] = (shape, ShardedGrad(param, name=slot.name, strategy=self.strategy,
                                                                  rank=self.rank))
            param.grad = made[1]
