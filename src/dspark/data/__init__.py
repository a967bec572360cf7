"""Data loading for data-parallel training: each rank loads only its rows of each global batch, in an
order that is a function of ``(seed, epoch)`` alone (so N ranks see what one process sees), with an
exact, world-size-independent resume position; and evaluation across ranks (predictions gathered in
dataset order, metrics averaged with the right weights).

Example::

    loader = dspark.DataLoader(dataset, global_batch_size=256, shuffle=True, seed=0)
    for x, y in loader: ...
"""

from dspark.data.loader import DataLoader
from dspark.data.metrics import gather_for_metrics, reduce_metrics
from dspark.data.order import BatchInfo
from dspark.data.sampler import GlobalBatchSampler

__all__ = ["BatchInfo", "DataLoader", "GlobalBatchSampler", "gather_for_metrics", "reduce_metrics"]
