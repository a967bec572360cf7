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
"""

# checkpoint and comm: subpackages a user reaches as attributes after `import dspark`
# (dspark.checkpoint.is_checkpoint, dspark.comm.transport); not names of the API itself.
from dspark import checkpoint as checkpoint
from dspark import comm as comm
from dspark._version import __version__
from dspark.comm import World, get_world, init, shutdown
from dspark.data import DataLoader, gather_for_metrics, reduce_metrics
from dspark.engine import Engine, meta_init
from dspark.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    DSparkError,
    NotInitializedError,
    PlacementError,
)
from dspark.launch.preemption import preemption_requested
from dspark.logs import Tracker, log_dir, progress
from dspark.logs import rank_print as print  # dspark.print: the rank-aware print

# dspark.plan is the function (the package stays importable: ``from dspark.plan import Plan``)
from dspark.plan import Plan, PlanRow, plan
from dspark.tensor import (
    REPLICATE,
    DistTensor,
    Replicate,
    Shard,
    distribute_batch,
    distribute_tensor,
)

__all__ = [
    "REPLICATE",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DSparkError",
    "DataLoader",
    "DistTensor",
    "Engine",
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
