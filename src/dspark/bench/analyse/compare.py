"""Two sets of results side by side: what got faster, slower, or stayed within noise.

Rows are matched by configuration key; when a side holds the same configuration more than once
(a commit measured twice), its newest result by timestamp stands for it. Verdicts follow the
noise rule of :mod:`dspark.bench.analyse.noise` (with the ledger's history when given) and read "B is ...
than A".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dspark.bench.analyse.noise import NoiseModel
from dspark.bench.ledger.schema import utc_timestamp
from dspark.bench.result import BenchResult, ConfigKey

__all__ = ["ROW_VERDICTS", "Comparison", "ComparisonRow", "compare"]

ROW_VERDICTS = ("faster", "slower", "within noise", "only in A", "only in B")


@dataclass(frozen=True, kw_only=True, slots=True)
class ComparisonRow:
    """One configuration in A, B, or both."""

    key: ConfigKey
    a: BenchResult | None
    b: BenchResult | None
    verdict: str
    """One of :data:`ROW_VERDICTS`: how B's step time compares with A's."""
    noise_band: float | None
    """The relative change that counted as noise for this row (None unless in both)."""
    noise_band_source: str | None = None
    """Where that band came from (the default, the host's history, a result's own spread)."""

    @property
    def a_step_ms(self) -> float | None:
        return self.a.step_ms if self.a else None

    @property
    def b_step_ms(self) -> float | None:
        return self.b.step_ms if self.b else None

    @property
    def delta_pct(self) -> float | None:
        """``(B - A) / A`` in percent; negative when B is faster."""
        if self.a is None or self.b is None or self.a.step_ms <= 0:
            return None
        return (self.b.step_ms / self.a.step_ms - 1) * 100

    @property
    def peak_bytes_delta(self) -> int | None:
        """B's peak bytes per rank minus A's."""
        if self.a is None or self.b is None:
            return None
        return self.b.peak_bytes_per_rank - self.a.peak_bytes_per_rank


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """All rows, sorted by configuration key."""

    rows: tuple[ComparisonRow, ...]
    a_label: str = "A"
    b_label: str = "B"

    def by_verdict(self, verdict: str) -> list[ComparisonRow]:
        """The rows with ``verdict`` (one of :data:`ROW_VERDICTS`)."""
        if verdict not in ROW_VERDICTS:
            raise ValueError(f"verdict={verdict!r} is not one of {ROW_VERDICTS}")
        return [row for row in self.rows if row.verdict == verdict]


def _time_order(result: BenchResult) -> str:
    try:
        return utc_timestamp(result.timestamp)
    except ValueError:  # no usable timestamp (e.g. a hand-made --json file): list order decides
        return ""


def _newest_by_key(results: Sequence[BenchResult]) -> dict[ConfigKey, BenchResult]:
    newest: dict[ConfigKey, BenchResult] = {}
    # A stable sort keeps list order among equal timestamps, so the later entry still wins.
    for result in sorted(results, key=_time_order):
        newest[result.key] = result
    return newest


def compare(a: list[BenchResult], b: list[BenchResult], *, a_label: str = "A",
            b_label: str = "B", noise: NoiseModel | None = None) -> Comparison:
    """Match ``a`` and ``b`` by configuration and judge B's step time against A's, with the noise
    bands of ``noise`` (default: no history, the machine's default range).

    Example::

        noise = NoiseModel.from_history(ledger.results())
        comparison = compare(ledger.resolve("previous"), ledger.resolve("latest"), noise=noise)
        [row.key for row in comparison.by_verdict("slower")]
    """
    noise = noise or NoiseModel()
    a_by_key, b_by_key = _newest_by_key(a), _newest_by_key(b)
    rows = []
    for key in sorted(a_by_key.keys() | b_by_key.keys()):
        old, new = a_by_key.get(key), b_by_key.get(key)
        if old is None:
            rows.append(ComparisonRow(key=key, a=None, b=new, verdict="only in B",
                                      noise_band=None))
        elif new is None:
            rows.append(ComparisonRow(key=key, a=old, b=None, verdict="only in A",
                                      noise_band=None))
        else:
            band, source = noise.band_source(old, new)
            rows.append(ComparisonRow(key=key, a=old, b=new, verdict=noise.verdict(old, new),
                                      noise_band=band, noise_band_source=source))
    return Comparison(rows=tuple(rows), a_label=a_label, b_label=b_label)
