"""zero3's plan: which parameters each unit (see [Note: units] in :mod:`dspark.policy.units`) holds,
given the slots the engine made.

Pure structure, no process group: :func:`plan_units` gives each unit its parameters' slots,
:func:`loose_modules` finds the other modules that hold parameters.
:mod:`dspark.engine.zero3_units` gathers and frees them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dspark.engine.param_slot import ParamSlot
from dspark.policy.units import UnitPolicy, unit_modules

__all__ = ["Zero3Unit", "loose_modules", "plan_units"]

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
