"""strategy="auto": the fastest strategy that fits the budget, the same on every rank."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from torch import nn

import dspark
from dspark.planner.auto_choice import auto_plan, choose
from dspark.planner.table import needed_bytes
from tests.messages import assert_line_names, assert_names
from tests.planner.baseline import BASELINE_BYTES, pinned_baseline
from tests.planner.test_planner import _mlp

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _deep_mlp() -> nn.Module:
    """Eight hidden layers: zero3 gathers a few at a time, so sharding saves memory the plan can see
    (``_mlp``'s zero3 holds its three layers gathered at once, and its need is within a few KB of
    replicate's: which of the two is lower turns on the heap's fitted shares, not on the choice)."""
    torch.manual_seed(0)
    hidden = [m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())]
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), *hidden, nn.Linear(256, 10))


def _plan(budget: int):
    return auto_plan(_deep_mlp(), optimizer=ADAMW, precision="fp32", bucket_mb=25.0, num_ranks=2,
                     bus_bytes_per_s=1e9, backend="gloo", memory_budget=budget,
                     process_baseline_bytes=BASELINE_BYTES)


def test_everything_fits_replicate_and_a_smaller_budget_shards_more() -> None:
    roomy = _plan(1 << 40)
    assert choose(roomy).strategy == "replicate"
    replicate_need = needed_bytes(roomy.row("replicate", 2))
    tight = choose(_plan(replicate_need - 1))
    assert tight.strategy != "replicate" and tight.peak_bytes < roomy.row("replicate", 2).peak_bytes
    # and below that choice's need, one that needs less still (zero1 gathers its updated rows in
    # place, with no buffers after the step: on this model it needs the least)
    tight_need = needed_bytes(roomy.row(tight.strategy, 2))
    assert needed_bytes(roomy.row(choose(_plan(tight_need - 1)).strategy, 2)) < tight_need
    with pytest.raises(ValueError, match="no strategy fits on 2"):
        choose(_plan(1000))


def _with_steps(plan, steps: dict[str, float]):
    """``plan`` with each strategy's step set to ``steps[strategy]`` (all in communication)."""
    rows = tuple(dataclasses.replace(r, compute_ms=0.0, optimizer_ms=0.0,
                                     comm_exposed_ms=steps[r.strategy]) for r in plan.rows)
    return dataclasses.replace(plan, rows=rows)


def test_a_difference_below_what_the_link_probe_resolves_does_not_shard() -> None:
    roomy = _plan(1 << 40)
    near = {"replicate": 0.9, "zero1": 0.8, "zero2": 0.4, "zero3": 0.6}  # within TIE_MS of 0.4
    assert choose(_with_steps(roomy, near)).strategy == "replicate"
    far = {"replicate": 10.0, "zero1": 9.9, "zero2": 5.0, "zero3": 9.0}  # a real gap: zero2 wins
    assert choose(_with_steps(roomy, far)).strategy == "zero2"
    big = {"replicate": 204.0, "zero1": 210.0, "zero2": 200.0, "zero3": 250.0}  # within 2% of 200
    assert choose(_with_steps(roomy, big)).strategy == "replicate"


def test_a_gap_inside_the_probes_spread_does_not_shard() -> None:
    # a busy machine: the rounds spread, so each row's step range is wide and the ranges overlap
    roomy = _plan(1 << 40)
    steps = {"replicate": 120.0, "zero1": 155.0, "zero2": 108.0, "zero3": 160.0}
    spread = dataclasses.replace(_with_steps(roomy, steps), rows=tuple(
        dataclasses.replace(r, step_ms_low=0.85 * r.step_ms, step_ms_high=3.0 * r.step_ms)
        for r in _with_steps(roomy, steps).rows))
    assert choose(spread).strategy == "replicate"
    steady = dataclasses.replace(spread, rows=tuple(
        dataclasses.replace(r, step_ms_low=0.99 * r.step_ms, step_ms_high=1.01 * r.step_ms) for r in spread.rows))
    assert choose(steady).strategy == "zero2"  # a steady probe's 10% gap is real


def test_the_auto_table_says_what_it_did_not_measure() -> None:
    text = str(_plan(1 << 40))
    assert_line_names(text, "activations", "compute", "not measured")


def _auto_engine(budget: int | None) -> dict[str, object]:
    with pinned_baseline():
        engine = dspark.Engine(_deep_mlp(), optimizer=ADAMW, strategy="auto", memory_budget=budget)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(dspark.get_world().rank))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    out = {"strategy": engine.strategy.name,
           "replicate_need": needed_bytes(engine.plan.row("replicate", 2))}
    engine.close()
    return out


def test_auto_engine_on_two_ranks(pool) -> None:
    roomy = pool.run(_auto_engine, None)
    assert [r["strategy"] for r in roomy] == ["replicate", "replicate"]
    budget = int(roomy[0]["replicate_need"]) - 1  # type: ignore[call-overload]
    tight = pool.run(_auto_engine, budget)
    assert tight[0]["strategy"] == tight[1]["strategy"] != "replicate"


def _probed(budgets: list[int], highs: list[tuple[int, int]]) -> str | int | None:
    """An auto engine whose rank's high water reads ``highs[rank]`` before and after auto measured,
    with ``budgets[rank]``: the refusal, or the probing peak the plan kept."""
    rank = dspark.get_world().rank
    with (mock.patch("dspark.planner.auto_choice.this_process_baseline_bytes", return_value=1 << 20),
          mock.patch("dspark.planner.auto_choice.high_water_bytes", side_effect=list(highs[rank]))):
        try:
            engine = dspark.Engine(_mlp(), optimizer=ADAMW, strategy="auto", memory_budget=budgets[rank])
        except ValueError as exc:
            return str(exc)
    peak = engine.plan.probing_peak_bytes
    engine.close()
    return peak


def test_auto_refuses_where_its_own_probes_went_over_the_smallest_budget(pool) -> None:
    """[Note: auto's own probes and the budget]: every row fits 350 MB, but rank 1's probes took its
    process to 400 MB, a new high, and rank 1 passed the smaller budget: every rank refuses, naming
    rank 1 and its peak. Where no rank's probes set a new high over the budget, the plan keeps the
    highest new high (rank 0's; rank 1 was already there)."""
    refused = pool.run(_probed, [1 << 40, 350_000_000], [(100_000_000, 150_000_000), (100_000_000, 400_000_000)])
    for message in refused:
        assert isinstance(message, str), refused
        assert_names(message, "rank 1", "400.0 MB", "memory_budget=350000000")
    kept = pool.run(_probed, [1 << 40, 1 << 40], [(100_000_000, 150_000_000), (400_000_000, 400_000_000)])
    assert kept == [150_000_000, 150_000_000]


def test_memory_budget_goes_with_auto_only_and_one_process_gets_replicate(single_process) -> None:
    with pytest.raises(ValueError, match="memory_budget=1000"):
        dspark.Engine(_mlp(), optimizer=ADAMW, strategy="zero2", memory_budget=1000)
    with pytest.raises(ValueError, match="memory_budget=-1"):
        dspark.Engine(_mlp(), optimizer=ADAMW, strategy="auto", memory_budget=-1)
    engine = dspark.Engine(_mlp(), optimizer=ADAMW, strategy="auto")
    assert engine.strategy.name == "replicate" and engine.plan.rows[0].devices == 1
    engine.close()


@pytest.mark.slow
def test_auto_works_from_the_engine_module_in_a_fresh_interpreter() -> None:
    """No registry and no import order (see [Note: auto as a plain function]): importing the engine
    alone is enough for strategy="auto" (it raised when dspark.plan had not been imported first)."""
    script = ("from dspark.engine import Engine\nimport dspark, functools, torch\ndspark.init()\n"
              "engine = Engine(torch.nn.Linear(8, 2), optimizer=functools.partial(torch.optim.SGD, lr=0.1), "
              "strategy='auto')\nprint(engine.strategy.name, len(engine.plan.rows), engine.config.strategy)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["replicate", "4", "auto"]
