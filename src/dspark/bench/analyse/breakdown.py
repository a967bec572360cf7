"""The step breakdown in the lab (``dspark bench --profile``): each rank's phases per configuration,
summarised from the raw ``engine.step_stats()`` of every timed step, and the straggler rule.

[Note: stragglers in the lab]
Collectives make every rank's step as long as the slowest rank's, so step times cannot name a slow
rank; ``compute_ms`` (forward + backward + optimizer without the waits, see [Note: step breakdown]
in :mod:`dspark.engine.step_observer`) can. A rank is a *straggler* when its median ``compute_ms``
exceeds the median of the other ranks' medians by more than the noise band plus
:data:`STRAGGLER_SLACK_MS`. The band is the widest of the machine's run-to-run range (the lab's one
noise rule, :meth:`dspark.bench.analyse.noise.NoiseModel.machine_range`: a default until the host's history
says otherwise) and each rank's own spread, ``(p90 - p10) / median`` of its ``compute_ms``: a rank
whose steps wander widely is no evidence of a straggler by less than that. The rule reads measured times only, like
every rule in :mod:`dspark.bench.analyse.anomalies`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from dspark.bench.analyse.anomalies import anomaly
from dspark.bench.analyse.noise import NoiseModel
from dspark.bench.analyse.trust import CORE_FOREIGN_ALLOWANCE
from dspark.bench.present.formatting import format_ms, format_ratio
from dspark.bench.result import BenchResult
from dspark.engine import STEP_STATS_KEYS

__all__ = ["PHASE_KEYS", "STRAGGLER_SLACK_MS", "ProfiledRound", "compute_band", "step_breakdown", "straggler"]

PHASE_KEYS = STEP_STATS_KEYS
"""The keys of a rank's breakdown: those of ``engine.step_stats()``."""
STRAGGLER_SLACK_MS = 1.0
"""Absolute slack of the straggler rule, so sub-millisecond jitter on tiny models is not flagged."""


class ProfiledRound(Protocol):
    """What the breakdown reads of one round's measurement (a
    :class:`~dspark.bench.ledger.measurement.Measurement`, which builds its result from this module: the
    breakdown names only the two fields it needs, so that no import goes back)."""

    @property
    def profiled(self) -> bool: ...

    @property
    def phase_ms_by_rank(self) -> list[dict[str, list[float]]]: ...


def step_breakdown(rounds: Sequence[ProfiledRound]) -> dict[str, Any]:
    """The :class:`~dspark.bench.result.BenchResult` fields of the step breakdown of ``rounds``
    (one configuration's measurements in one run): per rank, the median of each phase over every
    timed step of every profiled round, and the p10-p90 of ``compute_ms``.

    Example::

        step_breakdown(rounds)["phase_ms_by_rank"][1]["compute_ms"]   # rank 1's median, ms
    """
    profiled = [m for m in rounds if m.profiled and m.phase_ms_by_rank]
    num_ranks = max((len(m.phase_ms_by_rank) for m in profiled), default=0)
    medians: list[dict[str, float]] = []
    ranges: list[list[float]] = []
    for rank in range(num_ranks):
        pooled = {key: [ms for m in profiled if rank < len(m.phase_ms_by_rank)
                        for ms in m.phase_ms_by_rank[rank].get(key, [])] for key in PHASE_KEYS}
        medians.append({key: float(statistics.median(samples)) for key, samples in pooled.items()
                        if samples})
        compute = pooled["compute_ms"]
        low, high = (np.percentile(np.asarray(compute, dtype=np.float64), [10, 90]) if compute
                     else (0.0, 0.0))
        ranges.append([float(low), float(high)])
    return {"profiled": any(m.profiled for m in rounds), "phase_ms_by_rank": medians,
            "compute_ms_range_by_rank": ranges}


def compute_band(result: BenchResult, noise: NoiseModel | None = None) -> tuple[float, str]:
    """The relative noise band the straggler rule allows between ranks' ``compute_ms`` (see
    [Note: stragglers in the lab]), and where it came from, in words.

    Example::

        compute_band(result)   # (DEFAULT_RUN_TO_RUN, "the ... default run-to-run range (...)") with no history
    """
    noise = noise or NoiseModel()
    spreads = [((high - low) / phases["compute_ms"], f"rank {rank}'s own p10-p90 spread of compute")
               for rank, (phases, (low, high)) in enumerate(zip(
                   result.phase_ms_by_rank, result.compute_ms_range_by_rank, strict=False))
               if phases.get("compute_ms", 0.0) > 0]
    return max([noise.machine_range_source(result.host), *spreads], key=lambda c: c[0])


def _host(result: BenchResult, rank: int) -> str:
    hosts = result.hosts_by_rank
    return hosts[rank] if rank < len(hosts) and hosts[rank] else "an unrecorded host"


def straggler(result: BenchResult, noise: NoiseModel | None = None) -> list[dict[str, Any]]:
    """The rank whose compute is beyond the noise band slower than the other ranks' (see
    [Note: stragglers in the lab]), named with its host and the numbers; nothing without a
    breakdown (not profiled, a PyTorch peer, one rank).

    Example::

        straggler(result)
        # "rank 1 on host box computes <its median> per step, <ratio> the other ranks' <theirs> ..."
    """
    ranks = result.phase_ms_by_rank
    compute = [phases.get("compute_ms", 0.0) for phases in ranks]
    if len(compute) < 2 or min(compute) <= 0:
        return []
    slow = max(range(len(compute)), key=lambda rank: (compute[rank], -rank))
    others = [ms for rank, ms in enumerate(compute) if rank != slow]
    typical = statistics.median(others)
    band, source = compute_band(result, noise)
    if compute[slow] <= typical * (1 + band) + STRAGGLER_SLACK_MS:
        return []
    waits = [phases.get("comm_exposed_ms", 0.0) for rank, phases in enumerate(ranks) if rank != slow]
    own_wait = ranks[slow].get("comm_exposed_ms", 0.0)
    others_wait = statistics.median(waits)
    who = "the other rank" if len(others) == 1 else "the other ranks' median"
    shares = result.core_foreign_share_by_rank
    busy = shares[slow] if slow < len(shares) else None
    if busy is not None and busy > CORE_FOREIGN_ALLOWANCE:
        # Foreign work on the rank's core either took time from the rank or filled time the rank
        # left idle (a sleep, blocking I/O): the counters cannot tell which.
        cause = (f"its core ran other processes (or was stolen) for up to {busy:.0%} of a timed "
                 "window (see busy_machine): they took that time from the rank, or filled time "
                 "it left idle (blocked on I/O, sleeping); re-run on a quiet machine to tell")
    else:
        cause = ("that rank's device or core is slower, or it does more work per step than the "
                 "others (an uneven split of the data, extra work on that rank)")
    message = (f"rank {slow} on host {_host(result, slow)} computes {format_ms(compute[slow])} per "
               f"step (forward + backward + optimizer, waits excluded), "
               f"{format_ratio(compute[slow] / typical)} {who}'s {format_ms(typical)}, beyond the "
               f"noise band of {band:.0%} (from {source}); the others wait for it: their exposed communication is "
               f"{format_ms(others_wait)} per step, its own {format_ms(own_wait)}; likely cause: "
               f"{cause}")
    return [anomaly("straggler", message, rank=slow, host=_host(result, slow),
                    compute_ms_by_rank=compute, compute_ms=compute[slow], core_foreign_share=busy,
                    others_compute_ms=typical, noise_band=band, noise_band_source=source,
                    comm_exposed_ms_by_rank=[phases.get("comm_exposed_ms", 0.0) for phases in ranks])]
