"""The training engine: one code path, ZeRO stage and precision as policy values."""

from dspark.engine.audit import AUDIT_TOLERANCE, above_share, format_audit
from dspark.engine.config import ChecksConfig, CommunicationConfig, EngineConfig, ObservationConfig
from dspark.engine.engine import Engine, IncompatibleKeys
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.step_observer import STEP_STATS_KEYS
from dspark.engine.trace import named_ranges, trace_range
from dspark.meta.record import meta_init
from dspark.policy.strategies import PRECISIONS, STRATEGIES, PrecisionPolicy, ShardingPolicy

__all__ = [
           "AUDIT_TOLERANCE",
           "PRECISIONS",
           "STEP_STATS_KEYS",
           "STRATEGIES",
           "ChecksConfig",
           "CommunicationConfig",
           "Engine",
           "EngineConfig",
           "IncompatibleKeys",
           "LossScaler",
           "ObservationConfig",
           "PrecisionPolicy",
           "ShardingPolicy",
           "above_share",
           "format_audit",
           "meta_init",
           "named_ranges",
           "trace_range",
]
