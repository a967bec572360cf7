"""zero3's rules that the engine runs and the planner prices: which modules are gathered
together (units), the tag each gather carries, how far ahead a gather starts.

[Note: units] A *unit* is a module whose parameters are gathered together: the root module, and by
default every module held in an ``nn.ModuleList`` / ``nn.Sequential`` (a model's repeated blocks);
one nested inside another such unit only when it holds at least :data:`MIN_NESTED_UNIT_BYTES` of
parameters. Every gather is a collective, whose latency a few kilobytes do not pay for: a ResNet's
blocks hold ``nn.Sequential`` shortcuts (a 1x1 convolution and a BatchNorm of 32 parameters), and
its early stages are Sequentials of blocks of a few kilobytes; split down to every such child,
resnet50-cpu had three times as many units, most of them tiny, and its zero3 step was slower than
with these units, and than with only its 4 stages (``dspark run --nproc 2
benchmarks/zero3_units.py`` measures the three).
``Engine(zero3_units=...)`` replaces the default with module classes or a predicate, taken as given.
A parameter belongs to the units it sits under, minus nested units; so the root unit holds what no
block claims (embeddings, heads) for the whole forward, which keeps functional uses such as a tied
output head working.

Pure structure, no process group: :func:`unit_modules` picks the modules;
:mod:`dspark.engine.zero3_plan` gives each its parameters' slots, :mod:`dspark.engine.zero3_units`
gathers and frees them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

__all__ = ["MIN_NESTED_UNIT_BYTES", "SECOND_PREFETCH_MAX_BYTES", "TAG_BYTES", "UnitPolicy", "unit_modules"]

UnitPolicy = Sequence[type[nn.Module]] | Callable[[str, nn.Module], bool] | None
"""Which modules are zero3 units besides the root: module classes, a ``(name, module) -> bool``
predicate, or None for the default (children of ``nn.ModuleList`` / ``nn.Sequential``)."""
MIN_NESTED_UNIT_BYTES = 1 << 20
"""The default units split a unit further (a container inside a block) only into pieces of at least
this many parameter bytes; smaller ones stay with the unit around them (see [Note: units])."""
SECOND_PREFETCH_MAX_BYTES = 16 << 20
"""The unit after next is gathered ahead too when its parameters take at most this many bytes whole
(see [Note: prefetch depth] in :mod:`dspark.engine.zero3_units`)."""
TAG_BYTES = 8
"""Bytes of the tag each zero3 gather carries beside the parameters (see [Note: gather tags] in
:mod:`dspark.engine.zero3_gather`)."""


def _is_unit(policy: UnitPolicy, name: str, module: nn.Module) -> bool:
    if callable(policy) and not isinstance(policy, (list, tuple)):
        return bool(policy(name, module))
    return isinstance(module, tuple(policy or ()))


def _whole_bytes(param: nn.Parameter) -> int:
    return param.numel() * param.element_size()


def unit_modules(root: nn.Module, policy: UnitPolicy = None, *,
                 param_bytes: Callable[[nn.Parameter], int] = _whole_bytes,
                 ) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every unit, the root first (see [Note: units]). ``param_bytes`` gives a
    parameter's whole size, for a model whose parameters are already sharded.

    Example::

        unit_modules(gpt, [Block])   # [("", gpt), ("blocks.0", ...), ("blocks.1", ...)]
    """
    units = [("", root)]
    if policy is None:
        candidates = []
        for name, module in root.named_modules():
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                for child_name, child in module.named_children():
                    if any(True for _ in child.parameters()):
                        candidates.append((f"{name}.{child_name}" if name else child_name, child))
        names = [name for name, _ in candidates]
        for name, module in candidates:
            nested = any(name.startswith(outer + ".") for outer in names)
            if not nested or sum(map(param_bytes, module.parameters())) >= MIN_NESTED_UNIT_BYTES:
                units.append((name, module))
    else:
        for name, module in root.named_modules():
            if name and _is_unit(policy, name, module) and any(True for _ in module.parameters()):
                units.append((name, module))
    seen: set[int] = set()  # a module can sit in two containers: keep the first
    unique = []
    for name, module in units:
        if id(module) not in seen:
            seen.add(id(module))
            unique.append((name, module))
    return unique


