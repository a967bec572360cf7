"""engine.step_stats(): the arithmetic of the breakdown on a scripted clock (no process group), then
real steps on 2 gloo ranks: the phases cover the step, data_ms covers the gap between steps, and a rank
slowed on purpose shows a larger compute_ms while both ranks' step_ms stay alike."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import pytest
import torch
from torch import nn

import dspark
from dspark import comm
from dspark.engine import STEP_STATS_KEYS
from dspark.engine.step_observer import PHASES, StepObserver
from tests.messages import assert_names

FORWARD, BACKWARD, OPTIMIZER = (PHASES.index(p) for p in ("forward", "backward", "optimizer"))


class ScriptedClock:
    """Marks are whatever ``now`` says: the test moves time by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.released: list[Any] = []

    def stamp(self) -> float:
        return self.now

    def elapsed_ms(self, start: float, end: float) -> float:
        return end - start

    def release(self, marks: Any) -> None:
        self.released.extend(marks)


def _phase(observer: StepObserver, clock: ScriptedClock, phase: int, start: float, end: float,
           waits: tuple[tuple[float, float], ...] = (), ends_step: bool = False) -> None:
    clock.now = start
    observer.enter(phase)
    assert comm.current_observer() is observer  # the comm layer reports to it while the phase runs
    for wait_start, wait_end in waits:
        clock.now = wait_start

        def blocked(until: float = wait_end) -> None:
            clock.now = until

        observer.wait("all_reduce", None, blocked)
    clock.now = end
    observer.leave(ends_step=ends_step)
    assert comm.current_observer() is None


def test_breakdown_arithmetic_on_a_scripted_clock() -> None:
    clock = ScriptedClock()
    observer = StepObserver(torch.device("cpu"), rank=0, clock=clock)
    with pytest.raises(RuntimeError) as caught:
        observer.step_stats()
    assert_names(str(caught.value), "step_stats()", "engine.step()")
    # window 1: two micro-steps (forward + backward each), then the optimizer
    _phase(observer, clock, FORWARD, 10, 20, waits=((12, 15),))
    _phase(observer, clock, BACKWARD, 22, 40, waits=((30, 31), (35, 38)))
    _phase(observer, clock, FORWARD, 41, 45)
    _phase(observer, clock, BACKWARD, 46, 50)
    _phase(observer, clock, OPTIMIZER, 51, 60, waits=((52, 54),), ends_step=True)
    assert observer.step_stats() == {
        "step_ms": 50.0, "forward_ms": (10 - 3) + 4, "backward_ms": (18 - 4) + 4,
        "comm_exposed_ms": 3 + 4 + 2, "optimizer_ms": 9 - 2, "data_ms": 0.0,
        "compute_ms": 11 + 18 + 7}
    # window 2 starts 15 ms after window 1's step() ended
    _phase(observer, clock, FORWARD, 75, 76)
    _phase(observer, clock, BACKWARD, 76, 80)
    _phase(observer, clock, OPTIMIZER, 80, 81, ends_step=True)
    stats = observer.step_stats()
    assert stats["data_ms"] == 15.0 and stats["step_ms"] == 6.0 and stats["comm_exposed_ms"] == 0.0
    assert tuple(stats) == STEP_STATS_KEYS


def test_a_failed_phase_breaks_the_window_off() -> None:
    clock = ScriptedClock()
    observer = StepObserver(torch.device("cpu"), rank=0, clock=clock)
    _phase(observer, clock, FORWARD, 0, 5)
    clock.now = 6
    observer.enter(BACKWARD)
    observer.leave(failed=True)  # e.g. a shape error in backward: the window's marks are dropped
    assert comm.current_observer() is None
    assert clock.released == [0, 5, 6]
    _phase(observer, clock, FORWARD, 100, 101)
    _phase(observer, clock, OPTIMIZER, 101, 103, ends_step=True)
    assert observer.step_stats()["step_ms"] == 3.0  # the new window starts at the next forward


# -- real steps on 2 ranks ---------------------------------------------------------------------------
class SleepOnRank(nn.Module):
    """Identity that sleeps ``seconds`` in its forward on one rank: a straggler made on purpose."""

    def __init__(self, rank: int, seconds: float) -> None:
        super().__init__()
        self.rank, self.seconds = rank, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dspark.get_world().rank == self.rank:
            time.sleep(self.seconds)
        return x


def _model(slow_rank: int = -1, seconds: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(SleepOnRank(slow_rank, seconds), nn.Linear(32, 256), nn.Tanh(),
                         nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))


def _train(strategy: str, steps: int, *, gap_s: float = 0.0, slow_rank: int = -1, sleep_s: float = 0.0,
           accum: int = 1) -> list[dict[str, float]]:
    """Per step: the engine's stats, plus the test's own clock around the step and the gap before it."""
    engine = dspark.Engine(_model(slow_rank, sleep_s), strategy=strategy, grad_accum_steps=accum,
                           optimizer=functools.partial(torch.optim.SGD, lr=1e-2), bucket_mb=0.05)
    out = []
    after_step = None
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batches = [dspark.distribute_batch((torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)))
                   for _ in range(accum)]
        time.sleep(gap_s)
        start = time.perf_counter()
        for x, y in batches:
            engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        end = time.perf_counter()
        stats = engine.step_stats()
        stats["wall_ms"] = (end - start) * 1e3
        stats["gap_ms"] = (start - after_step) * 1e3 if after_step is not None else 0.0
        after_step = end
        out.append(stats)
    engine.close()
    return out


def _median(steps: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in steps)


@pytest.mark.parametrize("strategy,accum", [("replicate", 1), ("zero3", 2)])
def test_phases_add_up_to_the_step(pool, strategy: str, accum: int) -> None:
    for rank_steps in pool.run(_train, strategy, 6, gap_s=0.02, accum=accum):
        steps = rank_steps[1:]  # the first step learns the bucket order
        for s in steps:
            assert set(s) == {*STEP_STATS_KEYS, "wall_ms", "gap_ms"}
            assert all(s[k] >= 0.0 for k in STEP_STATS_KEYS), s
            phases = s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"] + s["comm_exposed_ms"]
            assert phases <= s["step_ms"] + 1e-6, s  # disjoint parts of the step: never more
            assert s["compute_ms"] == pytest.approx(s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"])
            assert s["step_ms"] <= s["wall_ms"] + 1e-6, s  # inside the test's own clock
            assert s["data_ms"] >= s["gap_ms"] - 1e-6, s  # the gap lies inside [step end, forward]
        # A part the breakdown missed would be missing from every step; a shared machine's hiccups
        # only ever add time, to some steps. So each bound holds for the step it suits best (the
        # least disturbed), not for the median: a loaded CI machine put the median of wall - step
        # 1.07 ms over a 1 ms bound while every rule held in the quieter steps.
        uncovered = min(s["step_ms"] - (s["forward_ms"] + s["backward_ms"] + s["optimizer_ms"]
                                        + s["comm_exposed_ms"]) for s in steps)
        assert uncovered <= 0.1 * _median(steps, "step_ms") + 1.0, steps  # all but the loss function
        assert min(s["wall_ms"] - s["step_ms"] for s in steps) <= 1.0, steps  # step_ms is the whole step
        assert min(s["data_ms"] - s["gap_ms"] for s in steps) <= 2.0, steps  # data_ms is the gap
        assert _median(steps, "data_ms") >= 20.0


@pytest.mark.serial
def test_a_slow_rank_shows_in_compute_not_in_step_time(pool) -> None:
    sleep_ms = 150.0
    per_rank = pool.run(_train, "replicate", 5, slow_rank=1, sleep_s=sleep_ms / 1e3)
    fast, slow = ([s for s in steps[1:]] for steps in per_rank)
    # rank 1 slept in its forward; rank 0 spent that time waiting for rank 1's gradients
    assert _median(slow, "forward_ms") >= sleep_ms
    assert _median(slow, "compute_ms") - _median(fast, "compute_ms") >= 0.8 * sleep_ms, (fast, slow)
    assert _median(fast, "comm_exposed_ms") >= 0.8 * sleep_ms, fast
    # collectives equalise wall time: both ranks' steps last about as long
    step_fast, step_slow = _median(fast, "step_ms"), _median(slow, "step_ms")
    assert abs(step_fast - step_slow) <= 0.3 * max(step_fast, step_slow), (fast, slow)


@pytest.mark.serial
def test_a_healthy_run_has_alike_compute_on_both_ranks(pool) -> None:
    per_rank = pool.run(_train, "zero2", 5)
    compute = [_median(steps[1:], "compute_ms") for steps in per_rank]
    assert max(compute) - min(compute) <= 0.5 * max(compute) + 5.0, compute


def test_step_stats_before_a_step_names_the_rank(single_process) -> None:
    engine = dspark.Engine(_model(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(RuntimeError, match="rank 0: step_stats"):
        engine.step_stats()
    with torch.no_grad():
        engine(torch.randn(2, 32))  # evaluation: not a step
    with pytest.raises(RuntimeError):
        engine.step_stats()
    engine.close()


def test_a_refused_extra_backward_leaves_the_window_and_its_breakdown(single_process) -> None:
    """backward() once too often is refused with nothing changed: step() then applies the window's
    one backward, and the breakdown still holds that window's forward and backward."""
    engine = dspark.Engine(_model(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    engine.backward(engine(torch.randn(2, 32)).sum())
    with pytest.raises(RuntimeError, match=r"backward\(\).*2 times.*grad_accum_steps=1"):
        engine.backward(engine(torch.randn(2, 32)).sum())
    engine.step()
    stats = engine.step_stats()
    assert stats["forward_ms"] > 0 and stats["backward_ms"] > 0, stats
    assert stats["compute_ms"] <= stats["step_ms"] + 1e-6, stats
    engine.close()
