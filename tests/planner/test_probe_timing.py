"""The probe's step times ([Note: steady steps]): rounds until steady or said not to be, no fit that
promises more than linear speed-up, and an interval on every step prediction. Pure logic: the step
is a function of the batch with the noise a test chooses."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from dspark.planner import Probe, get_interconnect, row_cost
from dspark.planner.probe_record import Line
from dspark.planner.probe_timing import (
    MAX_ROUNDS,
    MIN_ROUNDS,
    STEADY_SPREAD,
    time_line,
    time_rounds,
)
from dspark.planner.table import format_plan, model_shape
from tests.planner.test_planner import _mlp


def _step(noise):
    """A step of ``1 ms + 0.5 ms x rows`` forward, twice that backward, 1 ms optimizer, each scaled
    by the next value of ``noise`` (seconds, as the runner returns them)."""
    factors = iter(noise)

    def step(rows: int) -> tuple[float, float, float]:
        f = next(factors)
        return f * (1 + 0.5 * rows) / 1e3, f * (2 + rows) / 1e3, f * 1.0 / 1e3
    return step


def test_a_steady_machine_stops_after_the_minimum_rounds() -> None:
    timing = time_rounds(_step(itertools.repeat(1.0)), (2, 8), steps=3)
    assert (timing.rounds, timing.steady, timing.spread) == (MIN_ROUNDS, True, 0.0)
    assert timing.forward_ms == Line(fixed=1.0, per_sample=0.5)
    assert len(timing.forward_ms_rounds) == MIN_ROUNDS and timing.refused_fits == ()


def test_a_busy_machine_is_reported_with_its_spread_not_averaged_away() -> None:
    # every other round twice as slow, as when another job takes the core half of the time
    slow_rounds = itertools.chain.from_iterable(itertools.repeat(f, 6) for f in itertools.cycle([1.0, 2.0]))
    timing = time_rounds(_step(slow_rounds), (2, 8), steps=3)
    assert timing.rounds == MAX_ROUNDS and not timing.steady
    assert timing.spread > STEADY_SPREAD
    assert timing.spread == pytest.approx(2 / 1.5 - 1 / 1.5)  # (2 - 1) / median 1.5


def test_a_fit_implying_more_than_linear_speed_up_is_refused() -> None:
    # 4 rows in 10 ms, 8 rows in 30 ms: the line's fixed part is -10 ms, so 2 ranks of 4 rows would
    # take 10 ms where one of 8 takes 30: a 3x speed-up on 2 ranks
    line, refused = time_line([(4, 10.0), (8, 30.0)])
    assert refused and line == Line(fixed=0.0, per_sample=30.0 / 8)
    assert line.at(4) * 2 >= line.at(8)
    kept, refused = time_line([(4, 20.0), (8, 30.0)])
    assert not refused and kept == Line(fixed=10.0, per_sample=2.5)


def _probe(**timing: object) -> Probe:
    base = Probe.from_one_step(device="cpu", batch=8, forward_ms=8.0, backward_ms=16.0, optimizer_ms=2.0,
                               step_bytes=1e6, num_params=6, unit_bytes=[1, 1, 1, 1])
    return dataclasses.replace(base, **timing)


def test_every_step_prediction_carries_the_rounds_interval() -> None:
    rounds = {"forward_ms_rounds": (Line(fixed=0.0, per_sample=0.8), Line(fixed=0.0, per_sample=1.2)),
              "backward_ms_rounds": (Line(fixed=0.0, per_sample=1.6), Line(fixed=0.0, per_sample=2.4)),
              "optimizer_ms_rounds": (1.5, 2.5), "timing_rounds": 8, "steady": False, "step_spread": 0.4}
    probe = _probe(**rounds)
    cost = row_cost(shape=model_shape(_mlp()), probe=probe, strategy="replicate", num_ranks=2, micro_batch=4,
                    passes=1, bucket_mb=25.0, link=get_interconnect("loopback-gloo"))
    step = cost.compute_ms + cost.comm_exposed_ms + cost.optimizer_ms
    assert cost.step_ms_low is not None and cost.step_ms_high is not None
    assert cost.step_ms_low < step < cost.step_ms_high
    assert cost.step_ms_high - cost.step_ms_low == pytest.approx(4 * (1.2 - 0.8 + 2.4 - 1.6) + 1.0)
    assert json.loads(json.dumps(dataclasses.asdict(cost)))["step_ms_high"] == cost.step_ms_high
    assert Probe.from_dict(json.loads(json.dumps(dataclasses.asdict(probe)))) == probe


def test_a_round_whose_line_falls_with_the_batch_predicts_no_negative_step() -> None:
    # dspark plan printed step ranges such as -3.8-0.5 on a busy machine
    probe = _probe(forward_ms_rounds=(Line(fixed=4.0, per_sample=-1.0), Line(fixed=0.0, per_sample=1.0)),
                   backward_ms_rounds=(Line(fixed=8.0, per_sample=-2.0), Line(fixed=0.0, per_sample=2.0)),
                   optimizer_ms_rounds=(0.0, 0.0), timing_rounds=8, steady=False, step_spread=0.9)
    cost = row_cost(shape=model_shape(_mlp()), probe=probe, strategy="replicate", num_ranks=1, micro_batch=8,
                    passes=1, bucket_mb=25.0, link=get_interconnect("loopback-gloo"))
    assert cost.step_ms_low is not None and cost.step_ms_low >= 0.0, cost


def test_the_table_says_how_sure_the_probe_is() -> None:
    import dspark
    from tests.planner.test_planner import _batch

    busy = _probe(forward_ms_rounds=(Line(fixed=0.0, per_sample=1.0),),
                  backward_ms_rounds=(Line(fixed=0.0, per_sample=2.0),),
                  optimizer_ms_rounds=(2.0,), timing_rounds=8, steady=False, step_spread=0.4,
                  refused_fits=("forward",))
    plan = dspark.plan(_mlp(), _batch(), probe=busy, devices=[1, 2], process_baseline_bytes=1)
    text = format_plan(plan)
    assert "NOT steady after 8 rounds" in text and "40%" in text and "step range" in text
    assert "forward time's fit implied more than linear speed-up" in text
