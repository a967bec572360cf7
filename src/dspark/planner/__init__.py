"""Plan before you run: every strategy's predicted peak memory and step time per rank on 1 to N
devices, from one short probe on one device; ``strategy="auto"``'s choice.

[Note: plan and engine] The engine imports the planner (``Engine(strategy="auto")`` calls
:func:`~dspark.planner.auto_choice.auto_choice`); the planner imports nothing of the engine. What
both read, the strategies and what each makes a rank hold, zero3's units, the optimizer kernel and
meta materialisation, lives below them in :mod:`dspark.policy` and :mod:`dspark.meta`, so the
prediction and the engine use one formula and the import graph has no circle. ``dspark.plan`` is
this package's :func:`plan`; the package is ``dspark.planner``.

Example::

    import dspark
    plan = dspark.plan(model, (x, y), loss_fn, devices=[1, 2, 8], precision="bf16", global_batch=256)
    print(plan); plan.best(devices=8)
"""

from dspark.planner.auto_choice import AutoChoice, AutoRequest, auto_choice
from dspark.planner.cost import ModelShape, RowCost, row_cost
from dspark.planner.device_profile import DEVICES, DeviceProfile, get_device_profile, scale_probe
from dspark.planner.interconnect import INTERCONNECTS, Interconnect, get_interconnect
from dspark.planner.probe import Probe
from dspark.planner.table import (
           Plan,
           PlanRow,
           default_memory_budget,
           format_plan,
           model_shape,
           plan,
)

__all__ = ["DEVICES", "INTERCONNECTS", "AutoChoice", "AutoRequest", "DeviceProfile", "Interconnect", "ModelShape",
           "Plan", "PlanRow", "Probe", "RowCost", "auto_choice", "default_memory_budget", "format_plan",
           "get_device_profile", "get_interconnect", "model_shape", "plan", "row_cost", "scale_probe"]
