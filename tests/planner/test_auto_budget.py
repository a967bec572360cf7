"""A budget is a promise: ``Engine(strategy="auto", memory_budget=B)`` either trains within ``B`` bytes
of process memory on every rank (its resident peak, libraries and allocator included: see [Note:
process memory]) or refuses to build. Budgets just above and just below what each strategy needs
(its predicted process peak plus :data:`dspark.planner.table.PEAK_MARGIN`, or auto's own probes'
peak where that is higher: [Note: auto's own probes and the budget]), on zoo models the
planner was not tuned for, each engine trained and its real peak measured. The same at larger sizes
in fresh processes: ``benchmarks/auto_budget.py``."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.bench.measure.memory import peak_rss_bytes, reset_peak_rss
from dspark.cpu_malloc import release_freed
from dspark.models.plan_zoo import build
from dspark.planner.process_memory import this_process_baseline_bytes
from dspark.planner.table import PEAK_MARGIN, needed_bytes

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_the_margin_covers_the_plans_largest_shortfall_on_the_kept_zoo() -> None:
    """PEAK_MARGIN is what keeps a budget when the predicted process peak is low: it must cover the
    largest measured / predicted process peak of the newest kept validation zoo (the artifact
    docs/figures.md#plan-validation renders), or auto can choose a row that breaks its budget."""
    kept = sorted(p.parent for p in RESULTS.glob("*/artifact.json")
                  if json.loads(p.read_text()).get("anchor") == "plan-validation"
                  and (p.parent / "plan-validation.json").is_file())
    assert kept, "no kept plan-validation artifact"
    rows = json.loads((kept[-1] / "plan-validation.json").read_text())["rows"]
    ratios = {(r["model"], r["precision"], r["strategy"], r["ranks"]):
              r["measured_process_peak_bytes"] / r["predicted_process_peak_bytes"]
              for r in rows if r.get("predicted_process_peak_bytes")}
    assert len(ratios) > 100, kept[-1]
    worst = max(ratios, key=ratios.__getitem__)
    assert 1 + PEAK_MARGIN >= ratios[worst], (kept[-1].name, worst, ratios[worst], PEAK_MARGIN)
SLACK = 16 << 20
"""How far above and below a strategy's need the budgets are: about 4% of a rank's process (a
rank's baseline moves by a few MB between the task's start and the plan, after the probe)."""
ROOM = 64 << 20
"""A budget this far above the largest need must be kept by choosing: the needs of these small
models are auto's own probes' peak ([Note: auto's own probes and the budget]), which moves by up to
tens of MB from run to run (the heap's layout under the link probe's largest collectives)."""


def _train_within(name: str, above_baseline: int) -> dict[str, Any]:
    """Build an auto engine with a budget of ``above_baseline`` bytes more than this rank's process
    holds now besides its tensors, and train two steps: the budget, this rank's process peak from
    the build on (or the refusal), and each strategy's need as the plan predicted it, relative to the
    same baseline. (A rank's baseline drifts from task to task in a pool process, a few MB per
    engine: the budgets follow it.)"""
    release_freed()  # what the last task's engine freed: the budget is read against what stays
    base = this_process_baseline_bytes(torch.device("cpu"))
    budget = base + above_baseline
    reset_peak_rss()
    model, batch, loss_fn = build(name, size="tiny")
    local = dspark.distribute_batch(batch, shard_dim=0)
    try:
        engine = dspark.Engine(model, optimizer=ADAMW, strategy="auto", memory_budget=budget,
                               sample_batch=local, loss_fn=loss_fn)
    except ValueError as exc:
        return {"budget": budget, "refused": str(exc), "measured": peak_rss_bytes()}
    for _ in range(2):
        for part in engine.micro_batches(local):
            loss = engine(**part).loss if loss_fn is None else loss_fn(engine(part[0]), part[1])
            engine.backward(loss)
        engine.step()
    row = engine.plan.row(engine.strategy.name, 2)
    out = {"budget": budget, "strategy": engine.strategy.name, "micro_batch": engine.micro_batch,
           "measured": peak_rss_bytes(),
           "predicted": row.process_peak_bytes, "probing": engine.plan.probing_peak_bytes,
           "needs": {r.strategy: max(needed_bytes(r), engine.plan.probing_peak_bytes or 0) - base
                     for r in engine.plan.rows}}
    engine.close()
    return out


@pytest.mark.parametrize("name", ["mlp-wide", "embed-tied"])
def test_auto_never_trains_over_its_budget(pool, name: str) -> None:
    pool.run(_train_within, name, 1 << 40)  # the first engine of a process imports what it needs
    needs = pool.run(_train_within, name, 1 << 40)[0]["needs"]
    ordered = sorted(needs.items(), key=lambda item: item[1])
    cases = []
    # just above and just below the largest and the smallest need, a budget nothing fits in, and
    # one with room, which must choose (a test of refusals alone would pass with auto refusing all)
    for strategy, offset in ([(s, n + d) for s, n in (ordered[-1], ordered[0]) for d in (SLACK, -SLACK)]
                             + [("-", 0), ("room", ordered[-1][1] + ROOM)]):
        ranks = pool.run(_train_within, name, offset)
        cases.append((strategy, ranks))
        assert ("refused" in ranks[0]) == ("refused" in ranks[1]), ranks  # every rank alike
        for rank in ranks:
            assert "refused" in rank or rank["measured"] <= rank["budget"], (name, strategy, rank)
    assert "refused" in cases[-2][1][0], cases[-2]
    assert "strategy" in cases[-1][1][0], cases[-1]
