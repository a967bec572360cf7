"""zero3's plan: which modules are gathered together (units) and which parameters each one holds.

[Note: units] A *unit* is a module whose parameters are gathered together: the root module, and by
default every module held in an ``nn.ModuleList`` / ``nn.Sequential`` (a model's repeated blocks);
one nested inside another such unit only when it holds at least :data:`MIN_NESTED_UNIT_BYTES` of
parameters. Every gather is a collective, whose latency a few kilobytes do not pay for: a ResNet's
blocks hold ``nn.Sequential`` shortcuts (a 1x1 convolution and a BatchNorm of 32 parameters), and
its early stages are Sequentials of 20 KB blocks; split down to every such child, resnet50-cpu had
31 units, 22 under 100 KB, and its zero3 step took 597 ms on 2 cores against 526 ms with these
units (10) and 546 ms with only its 4 stages (``benchmarks/zero3_units.py``, 3 rounds). ``Engine(zero3_units=...)`` replaces the default
with module classes or a predicate, taken as given. A parameter belongs to the units it sits under,
minus nested units; so the root unit holds what no block claims (embeddings, heads) for the whole
forward, which keeps functional uses such as a tied output head working.

Pure structure, no process group: :func:`unit_modules` picks the modules, :func:`plan_units` gives
each its parameters' slots, :func:`loose_modules` finds the other modules that hold parameters.
:mod:`dspark.engine.zero3_units` gathers and frees them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from dspark.engine.param_slot import ParamSlot

__all__ = ["MIN_NESTED_UNIT_BYTES", "UnitPolicy", "Zero3Unit", "loose_modules", "plan_units", "unit_modules"]

UnitPolicy = Sequence[type[nn.Module]] | Callable[[str, nn.Module], bool] | None
"""Which modules are zero3 units besides the root: module classes, a ``(name, module) -> bool``
predicate, or None for the default (children of ``nn.ModuleList`` / ``nn.Sequential``)."""
MIN_NESTED_UNIT_BYTES = 1 << 20
"""The default units split a unit further (a container inside a block) only into pieces of at least
this many parameter bytes; smaller ones stay with the unit around them (see [Note: units])."""


class Zero3Unit:
    """One unit: its place in :func:`plan_units`' list (0: the root), its module and the slots of
    the parameters it gathers."""

    def __init__(self, index: int, name: str, module: nn.Module, slots: list[ParamSlot]) -> None:
        self.index = index
        self.name = name
        self.label = f"dspark.gather.{name or 'root'}"  # its gathers in traces
        self.module = module
        self.slots = slots
        self.frozen = [s for s in slots if not s.requires_grad]
        self.whole_bytes = sum(s.numel * s.param.element_size() for s in slots)


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


def _owned_params(module: nn.Module, unit_ids: set[int]) -> list[nn.Parameter]:
    """Parameters under ``module`` that no nested unit claims (tied ones may appear in several)."""
    params: list[nn.Parameter] = list(module.parameters(recurse=False))
    for child in module.children():
        if id(child) in unit_ids:
            continue
        params.extend(_owned_params(child, unit_ids))
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]  # type: ignore[func-returns-value]


def plan_units(root: nn.Module, slots: Sequence[ParamSlot], policy: UnitPolicy = None) -> list[Zero3Unit]:
    """The units of ``root`` (the root first), each with the slots of the parameters it owns, for a
    model whose parameters ``slots`` already shard: their whole sizes come from the slots.

    Example::

        units = plan_units(model, slots)   # units[0].module is model
    """
    by_param = {id(s.param): s for s in slots}
    modules = unit_modules(root, policy, param_bytes=lambda p: by_param[id(p)].numel * p.element_size())
    unit_ids = {id(m) for _, m in modules}
    units = []
    for index, (name, module) in enumerate(modules):
        owned = _owned_params(module, unit_ids)
        units.append(Zero3Unit(index, name, module, [by_param[id(p)] for p in owned if id(p) in by_param]))
    return units


def loose_modules(root: nn.Module, units: Sequence[Zero3Unit], slots: Sequence[ParamSlot],
                  ) -> list[tuple[str, nn.Module, list[ParamSlot], Zero3Unit]]:
    """Every module that is not a unit but holds parameters of its own: ``(name, module, its own
    slots, the unit that gathers them)``; calling one outside its unit's forward finds them freed.

    Example::

        loose_modules(gpt, units, slots)   # [("head", head, [<slot head.weight>], <root unit>), ...]
    """
    by_param = {id(s.param): s for s in slots}
    unit_ids = {id(unit.module) for unit in units}
    owner: dict[int, Zero3Unit] = {}
    for unit in units:
        for slot in unit.slots:
            owner.setdefault(id(slot), unit)
    loose = []
    for name, module in root.named_modules():
        if id(module) in unit_ids:
            continue  # a unit gathers its own parameters when it is called
        own = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
        if own:
            loose.append((name, module, own, owner[id(own[0])]))
    return loose
