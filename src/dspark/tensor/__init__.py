"""Placements, shard arithmetic, distributed tensors and batches."""

from dspark.tensor.batch import distribute_batch
from dspark.tensor.dist_tensor import DistTensor, distribute_tensor
from dspark.tensor.placement import (
    REPLICATE,
    Placement,
    PlacementError,
    Replicate,
    Shard,
    to_placement,
)

__all__ = [
    "REPLICATE",
    "DistTensor",
    "Placement",
    "PlacementError",
    "Replicate",
    "Shard",
    "distribute_batch",
    "distribute_tensor",
    "to_placement",
]
