"""strategy="auto" given one step's batch: the micro-batch chosen with the strategy, the loop held to
it, and training with auto's choice equal to plain PyTorch on the whole batch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dspark
from dspark.planner.table import needed_bytes
from dspark.tensor.batch import split_batch
from tests.engine.harness import assert_close
from tests.planner.baseline import BASELINE_BYTES, pinned_baseline

ROWS = 64  # one step's batch on each rank
SGD = functools.partial(torch.optim.SGD, lr=0.05)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _wide() -> nn.Module:
    """Activations well above the model state, so the micro-batch moves the peak."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 2048), nn.Tanh(), nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 4))


def _global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * world_size, 16, generator=g), torch.randn(ROWS * world_size, 4, generator=g)


def _peaks(micro: int, optimizer=SGD) -> dict[str, int]:
    """Each strategy's need of the budget per rank on 2 ranks at micro-batch ``micro`` (one process,
    the rank's baseline pinned as the pool's tasks pin it)."""
    plan = dspark.plan(_wide(), _global_batch(0, 2), F.mse_loss, optimizer=optimizer, devices=[2],
                       memory_budget=1 << 40, max_micro_batch=micro, process_baseline_bytes=BASELINE_BYTES)
    assert all(r.micro_batch == micro for r in plan.rows)
    return {r.strategy: needed_bytes(r) for r in plan.rows}


def _train_auto(optimizer, budget: int, steps: int, accum: int | None = None) -> dict[str, object]:
    world = dspark.get_world()
    x, y = _global_batch(0, world.world_size)
    mine = slice(world.rank * ROWS, (world.rank + 1) * ROWS)
    with pinned_baseline():
        engine = dspark.Engine(_wide(), optimizer=optimizer, strategy="auto", memory_budget=budget,
                               sample_batch=(x[mine], y[mine]), loss_fn=F.mse_loss, grad_accum_steps=accum)
    refused = None
    for step in range(steps):
        x, y = _global_batch(step, world.world_size)
        for xs, ys in engine.micro_batches((x[mine], y[mine])):
            engine.backward(F.mse_loss(engine(xs), ys))
        engine.step()
    if engine.micro_batch < ROWS:
        try:
            engine(x[mine])
        except ValueError as exc:
            refused = str(exc)
        engine.eval()
        engine(x[mine])  # an evaluation forward of the whole batch is not the plan's business
        engine.train()
    out = {"strategy": engine.strategy.name, "micro": engine.micro_batch, "accum": engine.grad_accum_steps,
           "state": engine.full_state_dict(), "refused": refused}
    engine.close()
    return out


def _plain_pytorch(optimizer, steps: int, world_size: int) -> dict[str, torch.Tensor]:
    model = _wide()
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = _global_batch(step, world_size)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def test_split_batch_cuts_every_leaf_into_equal_parts() -> None:
    x, y = torch.arange(12.0).view(6, 2), torch.arange(6)
    parts = split_batch({"x": x, "y": y, "ids": ["a", "b", "c", "d", "e", "f"], "n": 3}, 3)
    assert [p["ids"] for p in parts] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert torch.equal(torch.cat([p["x"] for p in parts]), x) and all(p["n"] == 3 for p in parts)
    assert torch.equal(parts[2]["y"], torch.tensor([4, 5]))
    with pytest.raises(ValueError, match=r"6 rows .* 4 equal"):
        split_batch((x, y), 4)
    with pytest.raises(ValueError, match=r"\[1\] has 5 rows"):
        split_batch((x, y[:5]), 2)
    with pytest.raises(ValueError, match="parts=0"):
        split_batch((x, y), 0)


@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_a_budget_only_smaller_micro_batches_fit_splits_the_step_and_trains_as_one_process(
        pool, optimizer) -> None:
    full, half = _peaks(ROWS, optimizer), _peaks(ROWS // 2, optimizer)
    # between the smallest peak at half the rows and the smallest at all of them: only a split fits
    budget = (min(full.values()) + min(half.values())) // 2
    assert min(half.values()) < budget < min(full.values()), (full, half)
    ranks = pool.run(_train_auto, optimizer, budget, 3)
    assert ranks[0]["strategy"] == ranks[1]["strategy"] and ranks[0]["micro"] == ranks[1]["micro"]
    micro, accum = ranks[0]["micro"], ranks[0]["accum"]
    assert micro * accum == ROWS and accum >= 2, ranks[0]
    assert f"of {ROWS} rows" in ranks[0]["refused"] and f"micro-batches of {micro}" in ranks[0]["refused"]
    assert_close(ranks[0]["state"], _plain_pytorch(optimizer, 3, world_size=2),
                 f"auto's {micro} x {accum} on 2 ranks against one process on the whole batch")


def test_a_roomy_budget_keeps_the_whole_batch_and_replicates(pool) -> None:
    ranks = pool.run(_train_auto, SGD, 1 << 40, 1)
    assert [(r["strategy"], r["micro"], r["accum"]) for r in ranks] == [("replicate", ROWS, 1)] * 2


def test_the_loops_own_accumulation_is_kept(pool) -> None:
    ranks = pool.run(_train_auto, SGD, 1 << 40, 1, 4)
    assert [(r["micro"], r["accum"]) for r in ranks] == [(ROWS // 4, 4)] * 2


def _build(budget: int, accum: int | None, target_rows: int = ROWS) -> str:
    """The engine's micro-batch choice as ``"micro x accum"``, or the ValueError it raised."""
    x, y = _global_batch(0, 1)
    try:
        with pinned_baseline():
            engine = dspark.Engine(_wide(), optimizer=SGD, strategy="auto", memory_budget=budget,
                                   sample_batch=(x[:ROWS], y[:target_rows]), loss_fn=F.mse_loss,
                                   grad_accum_steps=accum)
    except ValueError as exc:
        return f"ValueError: {exc}"
    out = f"{engine.micro_batch} x {engine.grad_accum_steps}"
    engine.close()
    return out


def _build_on_rank_0_only(budget: int) -> str:
    """Only rank 0 passes a batch (only rank 0's is read); the others pass None."""
    x, y = _global_batch(0, 1)
    sample = (x[:ROWS], y[:ROWS]) if dspark.get_world().rank == 0 else None
    with pinned_baseline():
        engine = dspark.Engine(_wide(), optimizer=SGD, strategy="auto", memory_budget=budget,
                               sample_batch=sample, loss_fn=F.mse_loss if sample is not None else None)
    out = f"{engine.strategy.name} {engine.micro_batch} x {engine.grad_accum_steps}"
    engine.close()
    return out


def test_only_rank_0_needs_the_sample_batch(pool) -> None:
    full, half = _peaks(ROWS), _peaks(ROWS // 2)
    budget = (min(full.values()) + min(half.values())) // 2
    chosen = pool.run(_build_on_rank_0_only, budget)
    assert chosen[0] == chosen[1] and not chosen[0].endswith(" x 1"), chosen


def test_every_rank_raises_what_rank_0s_probe_met(pool) -> None:
    # y has one row fewer than x: rank 0's probe refuses the batch, and rank 1 must not wait forever
    errors = pool.run(_build, 1 << 40, None, ROWS - 1)
    assert errors[0] == errors[1] and "leading sizes" in errors[0], errors


def test_a_fixed_micro_batch_that_does_not_fit_names_the_way_out(pool) -> None:
    full, half = _peaks(ROWS), _peaks(ROWS // 2)
    budget = (min(full.values()) + min(half.values())) // 2
    fixed_full, fixed_half = pool.run(_build, budget, 1), pool.run(_build, budget, 2)
    assert fixed_full[0] == fixed_full[1] and f"micro-batch of {ROWS}" in fixed_full[0], fixed_full
    assert "grad_accum_steps" in fixed_full[0]
    assert fixed_half == [f"{ROWS // 2} x 2"] * 2


def test_auto_arguments_fail_closed(single_process) -> None:
    x, y = _global_batch(0, 1)
    with pytest.raises(ValueError, match="sample_batch="):
        dspark.Engine(_wide(), optimizer=SGD, strategy="zero2", sample_batch=(x, y))
    with pytest.raises(ValueError, match="loss_fn="):
        dspark.Engine(_wide(), optimizer=SGD, strategy="auto", loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"64 rows.*grad_accum_steps=3"):
        dspark.Engine(_wide(), optimizer=SGD, strategy="auto", sample_batch=(x, y), loss_fn=F.mse_loss,
                      grad_accum_steps=3)
    with pytest.raises(ValueError, match="grad_accum_steps=0"):
        dspark.Engine(_wide(), optimizer=SGD, strategy="auto", grad_accum_steps=0)


def test_the_probe_leaves_the_random_generator_alone(single_process) -> None:
    x, y = _global_batch(0, 1)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.Linear(64, 4))  # dropout draws
    torch.set_rng_state(before)
    engine = dspark.Engine(model, optimizer=SGD, strategy="auto", sample_batch=(x, y), loss_fn=F.mse_loss)
    assert torch.equal(torch.get_rng_state(), before)
    engine.close()


def test_a_fresh_script_needs_only_import_dspark_and_shows_the_choice(tmp_path) -> None:
    # the planner is not imported by `import dspark` (a lazy package): dspark.Engine brings it along
    import subprocess
    import sys
    script = ("import functools, torch, dspark\n"
              "dspark.init(backend='gloo')\n"
              "e = dspark.Engine(torch.nn.Linear(4, 4), optimizer=functools.partial(torch.optim.SGD, lr=0.1),"
              " strategy='auto')\n"
              "print('chose', e.strategy.name)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "chose replicate" in out.stdout, out.stderr[-2000:]
    # no logging set up by the script: the choice and its table still show, on stderr
    assert "strategy='auto' chose replicate" in out.stderr and "peak MB" in out.stderr, out.stderr
