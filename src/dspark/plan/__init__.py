"""Plan before you run: every strategy's predicted peak memory and step time per rank on 1 to N
devices, from one short probe on one device; ``strategy="auto"``'s choice.

[Note: plan and engine] ``plan/`` sits beside ``engine/`` and imports it (the engine's own
expected-bytes formula, its bucket grouping and zero3 units, its meta materialisation); the engine
never imports ``plan/``. ``Engine(strategy="auto")`` asks the resolver this package registers with
:func:`dspark.engine.auto.set_auto_resolver` when it is imported (``dspark.Engine`` imports it), so
the choice lives here and the import graph has no circle.

Example::

    import dspark
    plan = dspark.plan(model, (x, y), loss_fn, devices=[1, 2, 8], precision="bf16", global_batch=256)
    print(plan); plan.best(devices=8)
"""

from dspark.plan import auto as auto  # registers Engine(strategy="auto")'s resolver
from dspark.plan.cost import ModelShape, RowCost, row_cost
from dspark.plan.interconnect import INTERCONNECTS, Interconnect, get_interconnect
from dspark.plan.planner import Plan, PlanRow, default_memory_budget, format_plan, model_shape, plan
from dspark.plan.probe import Probe

__all__ = ["INTERCONNECTS", "Interconnect", "ModelShape", "Plan", "PlanRow", "Probe", "RowCost",
           "default_memory_budget", "format_plan", "get_interconnect", "model_shape", "plan", "row_cost"]
