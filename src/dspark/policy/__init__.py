"""The rules the engine runs and the planner predicts from, as values: the strategies and precisions
(what each shards, in which dtypes it computes), what each makes a rank hold in bytes, zero3's
units, and the optimizer kernel. Below both (see [Note: auto as a plain function] in
:mod:`dspark.engine.auto_strategy`): no process group, nothing of the engine's or the planner's.

Example::

    from dspark.policy import STRATEGIES, expected_state_bytes
    expected_state_bytes(model.parameters(), STRATEGIES["zero2"], rank=0, num_ranks=2,
                         optimizer_state=(2, True))   # {"params": ..., "grads": ..., "optimizer": ...}
"""

from dspark.policy.optimizer_kernel import kernel_name, prefer_fused_kernel
from dspark.policy.rank_groups import GroupLayout, group_layout
from dspark.policy.state_bytes import expected_state_bytes, optimizer_state_elements
from dspark.policy.strategies import (
    HYBRID_STRATEGIES,
    PRECISIONS,
    STRATEGIES,
    PrecisionPolicy,
    ShardingPolicy,
    all_strategies,
    precision_policy,
    sharding_policy,
)
from dspark.policy.units import UnitPolicy, unit_modules

__all__ = ["HYBRID_STRATEGIES", "PRECISIONS", "STRATEGIES", "GroupLayout", "PrecisionPolicy", "ShardingPolicy",
           "UnitPolicy", "all_strategies", "expected_state_bytes", "group_layout", "kernel_name",
           "optimizer_state_elements", "precision_policy", "prefer_fused_kernel", "sharding_policy",
           "unit_modules"]
