"""The training engine: one code path, ZeRO stage and precision as policy values."""

from dspark.engine.engine import Engine
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.policy import PRECISIONS, STRATEGIES, PrecisionPolicy, ShardingPolicy

__all__ = ["PRECISIONS", "STRATEGIES", "Engine", "LossScaler", "PrecisionPolicy", "ShardingPolicy"]
