"""When is one step time really different from another? The bench lab's one noise rule.

[Note: noise rule]
Two results of one configuration differ beyond noise when the median moved by more than the noise
band. The band is the widest of:

* the machine's run-to-run range: how far same-code reruns on this host moved, over all its
  configurations (the median of their relative ranges, once at least three configurations were
  rerun; until then at least :data:`DEFAULT_RUN_TO_RUN`, a round figure of the order same-code reruns
  of one configuration move by on the project's shared 2-core box: compare the quick suite's two
  runs of one commit, docs/figures.md#2026-12-05-xeon-2vcpu-quick and its rerun beside it);
* this configuration's own history: the widest relative range of its same-code reruns on this
  host;
* the range each of the two results shows itself: the p10-p90 spread of its steps, and the range
  of its round medians (see [Note: rounds] in :mod:`dspark.bench.ledger.measurement`).

Both histories leave out the runs the two results come from: comparing two runs, their own
differences are what is being judged, not evidence of noise. A relative range is
``(max - min) / min``. The test is symmetric in ratio: B is *slower* when
``B > A * (1 + band)`` and *faster* when ``B < A / (1 + band)``. Regressions (analysis) and
``dspark bench compare`` both use it, so a report and a comparison never disagree.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from dspark.bench.result import BenchResult, ConfigKey

__all__ = ["DEFAULT_RUN_TO_RUN", "MIN_CONFIGS_FOR_MACHINE_RANGE", "NoiseModel", "Verdict",
           "observed_range", "relative_range"]

DEFAULT_RUN_TO_RUN = 0.15
"""The machine's run-to-run range until its own history says otherwise (see [Note: noise rule])."""
MIN_CONFIGS_FOR_MACHINE_RANGE = 3
"""Configurations rerun on the same code before their median range replaces the default."""

Verdict = Literal["faster", "slower", "within noise"]

_Group = tuple[str, ConfigKey, str]  # host, configuration, commit


def relative_range(values: Iterable[float]) -> float:
    """``(max - min) / min`` of positive values; 0 for fewer than two.

    Example::

        relative_range([100.0, 114.0, 105.0])   # 0.14
    """
    positive = [v for v in values if v > 0]
    if len(positive) < 2:
        return 0.0
    return (max(positive) - min(positive)) / min(positive)


def observed_range(result: BenchResult) -> float:
    """The widest spread ``result`` shows itself: ``(p90 - p10) / median`` of its steps, or the
    relative range of its round medians.

    Example::

        observed_range(result)   # 0.08 for p10=96, median=100, p90=104 and steady rounds
    """
    spread = (max(0.0, result.step_ms_p90 - result.step_ms_p10) / result.step_ms
              if result.step_ms > 0 else 0.0)
    return max(spread, relative_range(result.round_step_ms))


@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseModel:
    """The noise bands a ledger's history supports (see [Note: noise rule]).

    Example::

        noise = NoiseModel.from_history(ledger.results())
        noise.verdict(old, new)   # "slower", "faster" or "within noise"
    """

    reruns: dict[_Group, list[tuple[str, float]]] = field(default_factory=dict)
    """Same-code results by (host, configuration, commit): (run id, median step ms)."""

    @classmethod
    def from_history(cls, results: Iterable[BenchResult]) -> NoiseModel:
        """The model of every result given (typically all of a ledger's)."""
        reruns: dict[_Group, list[tuple[str, float]]] = {}
        for r in results:  # an injected fault says nothing of the machine ([Note: injected faults])
            if r.git_commit and not r.git_dirty and r.step_ms > 0 and not r.injected_faults:
                reruns.setdefault((r.host, r.key, r.git_commit), []).append((r.run_id, r.step_ms))
        return cls(reruns=reruns)

    def machine_range(self, host: str, *, leave_out: Iterable[str] = ()) -> float:
        """The run-to-run range of ``host`` without the runs ``leave_out`` (see [Note: noise rule])."""
        return self.machine_range_source(host, leave_out=leave_out)[0]

    def machine_range_source(self, host: str, *,
                             leave_out: Iterable[str] = ()) -> tuple[float, str]:
        """:meth:`machine_range` and, in words, where it came from: the default or the history.

        Example::

            NoiseModel().machine_range_source("box")
            # (DEFAULT_RUN_TO_RUN, "the ... default run-to-run range (box has 0 configurations
            #  rerun on one commit; its history replaces the default from 3)")
        """
        skip = set(leave_out)
        kept = [[ms for run_id, ms in members if run_id not in skip]
                for (group_host, _, _), members in self.reruns.items() if group_host == host]
        ranges = [relative_range(members) for members in kept if len(members) >= 2]
        if len(ranges) < MIN_CONFIGS_FOR_MACHINE_RANGE:
            band = max([DEFAULT_RUN_TO_RUN, *ranges])
            if band > DEFAULT_RUN_TO_RUN:
                return band, (f"{host}'s widest same-code rerun range ({len(ranges)} configuration(s) "
                              f"rerun, above the {DEFAULT_RUN_TO_RUN:.0%} default)")
            return band, (f"the {DEFAULT_RUN_TO_RUN:.0%} default run-to-run range ({host} has "
                          f"{len(ranges)} configuration(s) rerun on one commit; its history "
                          f"replaces the default from {MIN_CONFIGS_FOR_MACHINE_RANGE})")
        return statistics.median(ranges), (f"{host}'s run-to-run history (median range over "
                                           f"{len(ranges)} configurations rerun on one commit)")

    def config_range(self, host: str, key: ConfigKey, *, leave_out: Iterable[str] = ()) -> float:
        """The widest range of same-code reruns of ``key`` on ``host``, without the runs
        ``leave_out``."""
        skip = set(leave_out)
        return max([relative_range(ms for run_id, ms in members if run_id not in skip)
                    for (group_host, group_key, _), members in self.reruns.items()
                    if group_host == host and group_key == key], default=0.0)

    def band(self, a: BenchResult, b: BenchResult) -> float:
        """The relative change below which ``a`` and ``b`` count as the same speed.

        Example::

            NoiseModel().band(old, new)   # 0.15 for two steady results with no history
        """
        return self.band_source(a, b)[0]

    def band_source(self, a: BenchResult, b: BenchResult) -> tuple[float, str]:
        """:meth:`band` and, in words, which of [Note: noise rule]'s ranges set it, so that every
        message can say whether its band is the default or came from history.

        Example::

            NoiseModel().band_source(old, new)[1]   # "the ... default run-to-run range (...)"
        """
        pair = (a.run_id, b.run_id)
        candidates = [self.machine_range_source(host, leave_out=pair)
                      for host in sorted({a.host, b.host})]
        candidates += [(self.config_range(host, b.key, leave_out=pair),
                        f"this configuration's same-code reruns on {host}")
                       for host in sorted({a.host, b.host})]
        candidates += [(observed_range(r), f"{side}'s own spread (p10-p90 of its steps or its "
                                           "rounds' medians)") for side, r in (("A", a), ("B", b))]
        return max(candidates, key=lambda c: c[0])

    def verdict(self, a: BenchResult, b: BenchResult) -> Verdict:
        """How ``b``'s median step time compares with ``a``'s, under [Note: noise rule].

        Example::

            NoiseModel().verdict(old, new)   # "slower" when new is beyond the band above old
        """
        if a.step_ms <= 0 or b.step_ms <= 0:
            return "within noise"  # no timing to compare; the caller reports the raw numbers
        band = self.band(a, b)
        if b.step_ms > a.step_ms * (1 + band):
            return "slower"
        if b.step_ms < a.step_ms / (1 + band):
            return "faster"
        return "within noise"
