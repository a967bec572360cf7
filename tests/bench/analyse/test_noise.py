from __future__ import annotations

import pytest

from dspark.bench.analyse.noise import (
    DEFAULT_RUN_TO_RUN,
    NoiseModel,
    observed_range,
    relative_range,
)
from dspark.bench.result import BenchResult
from tests.bench.factory import make_result


def _run(step_ms: float, spread: float = 0.0, **kw: object) -> BenchResult:
    return make_result(**{"step_ms": step_ms, "step_ms_p10": step_ms * (1 - spread / 2),
                          "step_ms_p90": step_ms * (1 + spread / 2),
                          "round_step_ms": [step_ms] * 3, **kw})


def test_ranges() -> None:
    assert relative_range([100.0, 114.0, 105.0]) == pytest.approx(0.14)
    assert relative_range([100.0]) == 0.0
    assert observed_range(_run(100.0, 0.08)) == pytest.approx(0.08)
    # The rounds' medians moved more than the steps inside them scattered: the rounds count.
    assert observed_range(_run(100.0, 0.02, round_step_ms=[100.0, 125.0, 110.0])) == pytest.approx(0.25)


def test_band_is_never_below_the_observed_range_or_the_machine_range() -> None:
    quiet = NoiseModel()
    assert quiet.band(_run(100.0), _run(100.0)) == DEFAULT_RUN_TO_RUN
    assert quiet.band(_run(100.0, 0.02), _run(100.0, 0.30)) == pytest.approx(0.30)


def test_machine_range_comes_from_same_code_reruns_once_there_are_enough() -> None:
    def reruns(workload: str, *ms: float, commit: str = "a" * 40) -> list[BenchResult]:
        return [_run(m, workload=workload, run_id=f"{workload}-{i}", result_id=f"{workload}-{i}",
                     git_commit=commit) for i, m in enumerate(ms)]

    two = NoiseModel.from_history(reruns("a", 100.0, 103.0) + reruns("b", 100.0, 104.0))
    assert two.machine_range("box") == DEFAULT_RUN_TO_RUN  # too few configurations to trust
    three = NoiseModel.from_history(reruns("a", 100.0, 103.0) + reruns("b", 100.0, 104.0)
                                    + reruns("c", 100.0, 105.0))
    assert three.machine_range("box") == pytest.approx(0.04)
    assert three.machine_range("other-host") == DEFAULT_RUN_TO_RUN
    # Another commit's results are not reruns of the same code: a regression does not widen it.
    moved = NoiseModel.from_history(reruns("a", 100.0) + reruns("a", 160.0, commit="b" * 40))
    assert moved.config_range("box", _run(1.0, workload="a").key) == 0.0


def test_a_pair_is_not_its_own_evidence() -> None:
    history = [_run(100.0, run_id="r1", result_id="r1"), _run(130.0, run_id="r2", result_id="r2"),
               _run(101.0, run_id="r3", result_id="r3")]
    noise = NoiseModel.from_history(history)
    old, new = history[0], history[1]
    assert noise.config_range("box", old.key) == pytest.approx(0.30)
    assert noise.config_range("box", old.key, leave_out=("r1", "r2")) == 0.0
    assert noise.verdict(old, new) == "slower"  # +30%: beyond 15%, even though both are history


@pytest.mark.parametrize(("old", "new", "verdict"), [
    (_run(245.0), _run(290.0), "slower"),                   # +18% on steady runs
    (_run(245.0), _run(280.0), "within noise"),             # +14% < the 15% machine range
    (_run(245.0, 0.20), _run(290.0, 0.20), "within noise"),  # +18% but steps scatter by 20%
    (_run(290.0), _run(245.0), "faster"),
    (_run(100.0, 0.30), _run(70.0), "faster"),             # 100/70 = 1.43 > 1.30
    (_run(100.0, 0.50), _run(70.0), "within noise"),
])
def test_verdict(old: BenchResult, new: BenchResult, verdict: str) -> None:
    assert NoiseModel().verdict(old, new) == verdict


def test_two_runs_are_not_evidence_of_their_own_noise() -> None:
    # Run r2 is 30% slower than r1 on every configuration, same code: the slowdown being judged,
    # not a run-to-run range (before, the other configurations' pairs made the band 30%).
    history = [_run(ms, workload=w, run_id=run, result_id=f"{run}/{w}")
               for w in ("a", "b", "c") for run, ms in (("r1", 100.0), ("r2", 130.0))]
    noise = NoiseModel.from_history(history)
    assert noise.verdict(history[0], history[1]) == "slower"
    assert noise.band(history[0], history[1]) == DEFAULT_RUN_TO_RUN
    # A third, quiet run of the same code does count for the comparison of the first two.
    third = [_run(100.0, workload=w, run_id="r3", result_id=f"r3/{w}") for w in ("a", "b", "c")]
    assert NoiseModel.from_history(history + third).machine_range("box", leave_out=("r3",)) \
        == pytest.approx(0.30)


def test_every_band_says_where_it_came_from() -> None:
    def reruns(workload: str, *ms: float) -> list[BenchResult]:
        return [_run(m, workload=workload, run_id=f"{workload}-{i}", git_commit="a" * 40)
                for i, m in enumerate(ms)]

    band, source = NoiseModel().band_source(_run(100.0), _run(100.0))
    assert band == DEFAULT_RUN_TO_RUN and "15% default" in source and "box has 0" in source
    history = NoiseModel.from_history(reruns("a", 100.0, 120.0) + reruns("b", 100.0, 121.0)
                                      + reruns("c", 100.0, 125.0))
    band, source = history.band_source(_run(100.0, run_id="x"), _run(100.0, run_id="y"))
    assert band == pytest.approx(0.21) and "box's run-to-run history" in source
    band, source = history.band_source(_run(100.0, 0.5, run_id="x"), _run(100.0, run_id="y"))
    assert band == pytest.approx(0.5) and source.startswith("A's own spread")


def test_an_injected_fault_is_never_noise_history() -> None:
    # The finding: a run slowed with DSPARK_BENCH_SLOW_RANK became ordinary history.
    slowed = {"DSPARK_BENCH_SLOW_RANK": "1:100"}
    history = [_run(100.0, workload=w, run_id=f"{w}-{i}", git_commit="a" * 40,
                    injected_faults=slowed if i else {})
               for w in "abc" for i, _ in enumerate((0, 1))]
    assert NoiseModel.from_history(history).machine_range("box") == DEFAULT_RUN_TO_RUN
    assert NoiseModel.from_history(history).reruns == {
        ("box", r.key, "a" * 40): [(r.run_id, 100.0)] for r in history if not r.injected_faults}
