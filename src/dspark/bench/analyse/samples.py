"""Samples counted, not assumed: how many samples a step really trained, and the rule for a rank
that trained fewer than its share.

[Note: samples counted]
The batch probe counts the samples each rank's model received per step (``samples_by_rank``). A
step trains the distinct ones: their sum, at most the global batch (a replicated batch counts
once). Throughput (``samples_per_s``) and the speedup are computed from that count, not from the
configured global batch: ranks that each trained 12 of their 16 samples trained 24 of 32, and a
step time that looks twice as fast has done three quarters of the work. When the probe did not
count (a row from before it), the configured batch is assumed and ``samples_per_step`` is 0.
"""

from __future__ import annotations

from typing import Any

from dspark.bench.analyse.anomalies import anomaly
from dspark.bench.result import BenchResult

__all__ = ["counted_samples", "missing_samples", "rank_share"]


def counted_samples(samples_by_rank: list[int], global_batch: int) -> int:
    """The samples one step trained by the probe's count: the ranks' sum, at most the global
    batch; 0 when nothing was counted.

    Example::

        counted_samples([12, 12], 32)   # 24
        counted_samples([32, 32], 32)   # 32: a replicated batch trains its samples once
    """
    return min(sum(samples_by_rank), global_batch) if samples_by_rank else 0


def rank_share(global_batch: int, num_devices: int) -> int:
    """The fewest samples a rank's share holds (``torch.chunk``'s rule: the last may be shorter)."""
    return global_batch // num_devices


def missing_samples(result: BenchResult, baseline: BenchResult | None = None) -> list[dict[str, Any]]:
    """A rank's model received fewer samples per step than its share of the global batch (by the
    batch probe's count), so the step trained less than the configured batch.

    Example::

        missing_samples(result)   # "ranks 0 and 1 trained 12 samples per step each, short of ..."
    """
    if not result.samples_by_rank:
        return []
    share = rank_share(result.global_batch, result.num_devices)
    short = [(rank, n) for rank, n in enumerate(result.samples_by_rank) if n < share]
    if not short:
        return []
    trained = counted_samples(result.samples_by_rank, result.global_batch)
    who = "; ".join(f"rank {rank} trained {n}" for rank, n in short)
    message = (f"{who} sample(s) per step, short of a rank's share of {share} in the global batch "
               f"of {result.global_batch}: a step trained {trained} of {result.global_batch} "
               "samples, and throughput and speedup count those; likely cause: the loader drops or "
               "filters samples on some ranks, or the batch is split unevenly")
    return [anomaly("missing_samples", message, samples_by_rank=list(result.samples_by_rank),
                    share=share, trained_samples=trained, global_batch=result.global_batch)]
