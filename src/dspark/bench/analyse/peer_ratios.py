"""DSpark's step beside its peers' in one run: the step ratio of each pairing.

A pairing is a DSpark strategy and the peer that does the same job (:data:`PAIRINGS`: ``replicate``
and DDP, ``zero1``/``zero2`` and DeepSpeed's same stage, ``zero3`` and FSDP2 and DeepSpeed ZeRO-3),
measured in the same run on the same workload, device count, precision, global batch and batch
placement. [Note: the step ratio] The lab interleaves a run's configurations round by round, so a
round's DSpark launch and the same round's peer launch are minutes apart at most while rounds may
be further apart: the ratio is the median of the per-round ratios (DSpark's round median step / the
peer's, rounds paired by their index), with their lowest and highest, as the speedup is the median
of the rounds' ratios to their baseline. Below 1, DSpark's step is the shorter. A ratio of the two
pooled medians can fall outside the rounds' range when the rounds drift; this one cannot.

Ratios are taken within one run only: results from several runs are refused with the runs named,
since a round index pairs two launches only inside the run that interleaved them. Each ratio carries
what its two sides were flagged with; a side flagged ``busy_machine`` or run with a fault injected
is not trustworthy, and neither is a ratio built on it (:attr:`PeerRatio.untrustworthy`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dspark.bench.faults import describe_injected
from dspark.bench.result import BenchResult

__all__ = ["PAIRINGS", "UNTRUSTWORTHY_KINDS", "PeerRatio", "one_run", "peer_ratios"]

UNTRUSTWORTHY_KINDS = ("busy_machine",)
"""Anomalies that void a result's step times (other work took time from its ranks)."""

PAIRINGS: tuple[tuple[str, str], ...] = (
    ("replicate", "torch-ddp"),
    ("zero1", "deepspeed-zero1"),
    ("zero2", "deepspeed-zero2"),
    ("zero3", "torch-fsdp2"),
    ("zero3", "deepspeed-zero3"),
)
"""``(DSpark strategy, peer)``: each peer beside the DSpark strategy that does the same job."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerRatio:
    """One pairing's step ratio (see [Note: the step ratio])."""

    workload: str
    num_devices: int
    precision: str
    global_batch: int
    ours: str
    """DSpark's strategy."""
    theirs: str
    """The peer."""
    ours_ms: float
    """DSpark's median step (every timed step of every round)."""
    theirs_ms: float
    ratio: float
    """The median of the per-round ratios DSpark / peer."""
    lowest: float
    highest: float
    rounds: int
    """Rounds paired (the rounds both were measured in)."""
    run_id: str = ""
    """The one run both sides come from."""
    ours_flags: tuple[str, ...] = ()
    """DSpark's side: its anomaly kinds, and an injected fault when one was."""
    theirs_flags: tuple[str, ...] = ()
    untrustworthy: tuple[str, ...] = ()
    """Why the ratio cannot be trusted (``"DSpark busy_machine"``, ``"peer injected ..."``); ()
    when both sides can."""

    @property
    def verdict(self) -> str:
        """``"DSpark faster"`` or ``"peer faster"`` when every paired round says so, ``"rounds
        disagree"`` when they fall on both sides of 1 (the machine's noise is larger than the
        gap), ``"one round"`` when there is only one to go by."""
        if self.rounds < 2:
            return "one round"
        if self.highest < 1.0:
            return "DSpark faster"
        if self.lowest > 1.0:
            return "peer faster"
        return "rounds disagree"


def one_run(results: Sequence[BenchResult], what: str) -> str:
    """The run all of ``results`` come from; a ``ValueError`` naming the runs when they are several.

    Example::

        one_run(ledger.resolve("latest"), "peer ratios")   # "20261204T1907Z-3fa9c1"
    """
    runs = list(dict.fromkeys(r.run_id for r in results))
    if len(runs) > 1:
        raise ValueError(f"{what} pair rounds within one run, and these results come from "
                         f"{len(runs)} runs ({', '.join(runs)}): a round index pairs two launches "
                         "only inside the run that interleaved them; report one run (--run REF)")
    return runs[0] if runs else ""


def _flags(result: BenchResult) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(str(a.get("kind")) for a in result.anomalies))
    return kinds + ((describe_injected(result),) if result.injected_faults else ())


def _distrust(side: str, result: BenchResult) -> list[str]:
    bad = [f"{side} {kind}" for kind in _flags(result) if kind in UNTRUSTWORTHY_KINDS]
    return bad + ([f"{side} {describe_injected(result)}"] if result.injected_faults else [])


def _round_steps(result: BenchResult) -> dict[int, float]:
    indices = result.round_indices or list(range(len(result.round_step_ms)))
    return dict(zip(indices, result.round_step_ms, strict=False))


def peer_ratios(results: Sequence[BenchResult], *, min_devices: int = 2) -> list[PeerRatio]:
    """Every pairing present in ``results`` (one run's: several runs are a ``ValueError``) on
    ``min_devices`` devices or more, in the order the workloads first appear, then by device count
    and :data:`PAIRINGS`. A pairing whose results share no round (or have no round figures) is
    left out.

    Example::

        for r in peer_ratios(results):
            print(f"{r.workload}: {r.ours} / {r.theirs} = {r.ratio:.2f}")
    """
    run_id = one_run(results, "peer ratios")
    by_key: dict[tuple[str, int, str, int, str, str], BenchResult] = {}
    for result in results:  # the last result of a configuration wins, as in the results table
        by_key[(result.workload, result.num_devices, result.precision, result.global_batch,
                result.batch_placement, result.strategy)] = result
    groups = list(dict.fromkeys(key[:5] for key in by_key))
    order = {workload: i for i, workload in enumerate(dict.fromkeys(r.workload for r in results))}
    groups.sort(key=lambda g: (order[g[0]], g[1]))
    out = []
    for group in groups:
        if group[1] < min_devices:
            continue
        for ours, theirs in PAIRINGS:
            a, b = by_key.get((*group, ours)), by_key.get((*group, theirs))
            if a is None or b is None:
                continue
            mine, peers = _round_steps(a), _round_steps(b)
            per_round = [mine[i] / peers[i] for i in sorted(mine.keys() & peers.keys()) if peers[i] > 0]
            if not per_round:
                continue
            out.append(PeerRatio(workload=group[0], num_devices=group[1], precision=group[2],
                                 global_batch=group[3], ours=ours, theirs=theirs, ours_ms=a.step_ms,
                                 theirs_ms=b.step_ms, ratio=statistics.median(per_round),
                                 lowest=min(per_round), highest=max(per_round),
                                 rounds=len(per_round), run_id=run_id, ours_flags=_flags(a),
                                 theirs_flags=_flags(b),
                                 untrustworthy=tuple(_distrust("DSpark", a) + _distrust("peer", b))))
    return out
