"""DSpark: data-parallel training on 1 to N devices that scales, and proves that it scales.

Example::

    import dspark, functools, torch
    world = dspark.init()
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                           strategy="zero2", precision="bf16")
    x, y = dspark.distribute_batch((inputs, targets), shard_dim=0)
    loss = torch.nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    dspark.shutdown()

[Note: a lazy package] ``import dspark`` imports nothing heavy: each public name below is imported
from its module on first use (PEP 562's module ``__getattr__``). The ``dspark`` command is in
this package, so everything its package imports, every ``dspark run`` pays before the job starts:
PyTorch alone takes seconds (docs/figures.md#startup-time), paid again by PyTorch's launcher and by
each worker, and a Ctrl-C in that time came out as a traceback. Add a public name to ``_PUBLIC``
(and to the ``TYPE_CHECKING`` imports, for type checkers), never as an import at the top:
tests/test_import_cost.py fails on that.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dspark._version import __version__

if TYPE_CHECKING:
    # checkpoint and comm: subpackages a user reaches as attributes after `import dspark`
    # (dspark.checkpoint.is_checkpoint, dspark.comm.transport); not names of the API itself.
    from dspark import checkpoint as checkpoint
    from dspark import comm as comm
    from dspark.comm import World, get_world, init, shutdown
    from dspark.data import DataLoader, gather_for_metrics, reduce_metrics
    from dspark.engine import Engine, EngineConfig
    from dspark.errors import (
        CollectiveError,
        CollectiveTimeoutError,
        DSparkError,
        NotInitializedError,
        PlacementError,
    )
    from dspark.launch.preemption import preemption_requested
    from dspark.logs import Tracker, log_dir
    from dspark.logs import rank_print as print  # dspark.print: the rank-aware print
    from dspark.logs.progress import progress
    from dspark.meta import meta_init

    # dspark.plan is the planner's function; its package is dspark.planner
    from dspark.planner import Plan, PlanRow, plan
    from dspark.tensor import (
        REPLICATE,
        DistTensor,
        Replicate,
        Shard,
        distribute_batch,
        distribute_tensor,
    )

_PUBLIC: dict[str, tuple[str, str | None]] = {
    "checkpoint": ("dspark.checkpoint", None),
    "comm": ("dspark.comm", None),
    "World": ("dspark.comm", "World"),
    "get_world": ("dspark.comm", "get_world"),
    "init": ("dspark.comm", "init"),
    "shutdown": ("dspark.comm", "shutdown"),
    "DataLoader": ("dspark.data", "DataLoader"),
    "gather_for_metrics": ("dspark.data", "gather_for_metrics"),
    "reduce_metrics": ("dspark.data", "reduce_metrics"),
    "Engine": ("dspark.engine", "Engine"),
    "EngineConfig": ("dspark.engine", "EngineConfig"),
    "meta_init": ("dspark.meta", "meta_init"),
    "CollectiveError": ("dspark.errors", "CollectiveError"),
    "CollectiveTimeoutError": ("dspark.errors", "CollectiveTimeoutError"),
    "DSparkError": ("dspark.errors", "DSparkError"),
    "NotInitializedError": ("dspark.errors", "NotInitializedError"),
    "PlacementError": ("dspark.errors", "PlacementError"),
    "preemption_requested": ("dspark.launch.preemption", "preemption_requested"),
    "Tracker": ("dspark.logs", "Tracker"),
    "log_dir": ("dspark.logs", "log_dir"),
    "progress": ("dspark.logs", "progress"),
    "print": ("dspark.logs", "rank_print"),
    "Plan": ("dspark.planner", "Plan"),
    "PlanRow": ("dspark.planner", "PlanRow"),
    "plan": ("dspark.planner", "plan"),
    "REPLICATE": ("dspark.tensor", "REPLICATE"),
    "DistTensor": ("dspark.tensor", "DistTensor"),
    "Replicate": ("dspark.tensor", "Replicate"),
    "Shard": ("dspark.tensor", "Shard"),
    "distribute_batch": ("dspark.tensor", "distribute_batch"),
    "distribute_tensor": ("dspark.tensor", "distribute_tensor"),
}
"""Public name -> (module, attribute in it; None: the module itself)."""


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'dspark' has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # once: later reads find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = [
    "REPLICATE",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DSparkError",
    "DataLoader",
    "DistTensor",
    "Engine",
    "EngineConfig",
    "NotInitializedError",
    "PlacementError",
    "Plan",
    "PlanRow",
    "Replicate",
    "Shard",
    "Tracker",
    "World",
    "__version__",
    "distribute_batch",
    "distribute_tensor",
    "gather_for_metrics",
    "get_world",
    "init",
    "log_dir",
    "meta_init",
    "plan",
    "preemption_requested",
    "print",
    "progress",
    "reduce_metrics",
    "shutdown",
]
