"""Errors a user can make, and the consistency checks the engine does at construction."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import dspark
from dspark.engine.engine import engine_parts
from tests.engine import tiny_models as tm
from tests.engine.harness import run_or_explain_hang
from tests.messages import assert_line_names, assert_names

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _mismatched_model() -> str:
    world = dspark.get_world()
    model = tm.TinyMLP(hidden=7 if world.rank == 0 else 8)
    try:
        dspark.Engine(model, optimizer=ADAMW)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_model_mismatch_names_the_first_differing_parameter(pool) -> None:
    for rank, message in enumerate(pool.run(_mismatched_model)):
        assert message.startswith(f"rank {rank}: "), message
        assert_names(message, "model differs")
        assert_line_names(message, "layers.0.weight", "(7, 6)", "torch.float32", "requires_grad",
                          "rank 0")
        assert_line_names(message, "layers.0.weight", "(8, 6)", "torch.float32", "requires_grad",
                          "rank 1")


def _buffers_and_batchnorm() -> dict:
    world = dspark.get_world()
    torch.manual_seed(world.rank)  # different init per rank: the engine must broadcast rank 0's
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model[1].running_mean.fill_(float(world.rank))
    engine = dspark.Engine(model, optimizer=ADAMW, strategy="zero2")
    at_start = engine.full_state_dict()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    local = dspark.distribute_batch(x, shard_dim=0)
    engine.backward(engine(local).square().mean())
    engine.step()
    after = engine.full_state_dict()
    engine.close()
    return {"start": at_start, "after": after}


def test_parameters_and_buffers_start_from_rank_0_and_agree_after_steps(pool) -> None:
    r0, r1 = pool.run(_buffers_and_batchnorm)
    for key in r0["start"]:
        assert torch.equal(r0["start"][key], r1["start"][key]), key
    assert float(r0["start"]["1.running_mean"].abs().sum()) == 0.0  # rank 0's value won
    # each rank's running statistics moved with its own slice of the batch; a full state dict gives
    # rank 0's on every rank, never a mix
    assert float(r0["after"]["1.running_mean"].abs().sum()) > 0.0
    for key in r0["after"]:
        assert torch.equal(r0["after"][key], r1["after"][key]), key


@pytest.mark.parametrize("kwargs,match", [
    ({"strategy": "zero4"}, "'replicate', 'zero1', 'zero2', 'zero3'"),
    ({"strategy": None}, "'replicate', 'zero1'"),
    ({"precision": "fp8"}, "'fp32', 'bf16', 'fp16'"),
    ({"grad_accum_steps": 0}, "grad_accum_steps=0"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm=-1.0"),
    ({"bucket_mb": 0}, "bucket_mb=0"),
    ({"reduce_dtype": torch.int8}, "reduce_dtype=torch.int8"),
])
def test_bad_settings_are_errors_that_list_the_choices(single_process, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        dspark.Engine(tm.make("mlp"), optimizer=ADAMW, **kwargs)


def test_optimizer_instance_instead_of_factory(single_process) -> None:
    model = tm.make("mlp")
    with pytest.raises(TypeError, match=r"functools\.partial"):
        dspark.Engine(model, optimizer=torch.optim.AdamW(model.parameters()))


def test_step_and_backward_out_of_order(single_process) -> None:
    engine = dspark.Engine(tm.make("mlp"), optimizer=ADAMW, grad_accum_steps=2)
    with pytest.raises(RuntimeError, match="before backward"):
        engine.step()
    x, y = tm.batch("mlp", 4, 0)
    engine.backward(tm.loss_fn("mlp", engine(x), y))
    with pytest.raises(RuntimeError, match=r"save\(\).*1 of grad_accum_steps=2"):
        engine.save("/nonexistent/ckpt")
    engine.backward(tm.loss_fn("mlp", engine(x), y))
    with pytest.raises(RuntimeError, match="called 3 times"):
        engine.backward(tm.loss_fn("mlp", engine(x), y))
    assert engine.step() is True
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(engine(x))


def test_single_process_engine_matches_plain_pytorch(single_process) -> None:
    from tests.engine.harness import engine_state, reference_state, rel_error

    for strategy in ("replicate", "zero1", "zero2", "zero3"):
        got = engine_state("tied", strategy, 2)["state"]
        assert rel_error(got, reference_state("tied", 2)) <= 1e-6


def test_plain_loss_backward_is_refused_with_the_fix(single_process) -> None:
    engine = dspark.Engine(tm.make("mlp"), optimizer=ADAMW)
    x, y = tm.batch("mlp", 4, 0)
    with pytest.raises(RuntimeError, match=r"call engine\.backward\(loss\)"):
        tm.loss_fn("mlp", engine(x), y).backward()


class _UsesABlockWeightOutsideTheBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x @ self.blocks[0].weight.T  # read outside its block: gone under zero3


def _outside_use() -> str:
    engine = dspark.Engine(_UsesABlockWeightOutsideTheBlock(), optimizer=ADAMW, strategy="zero3")
    try:
        engine(torch.randn(2, 4))
    except RuntimeError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


def test_zero3_explains_a_parameter_used_outside_its_block(pool) -> None:
    for message in pool.run(_outside_use):
        assert_names(message, "[DSpark zero3]", "zero3_units=")
        assert "blocks.0.weight" in message and "strategy='zero2'" in message


class _HeadOnTheRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _direct_calls() -> dict[str, str]:
    """After a step, the user's code calls submodules itself (an eval helper, a probe): a unit
    gathers its parameters; a module inside a unit, or the root's own, refuses by name."""
    engine = dspark.Engine(_HeadOnTheRoot(), optimizer=ADAMW, strategy="zero3")
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    found = {"unit": str(tuple(engine.module.blocks[0](torch.randn(2, 4)).shape))}
    for what, call in (("head", lambda: engine.module.head(torch.randn(2, 4))),
                       ("inside", lambda: engine.module.blocks[1][0](torch.randn(2, 4)))):
        try:
            call()
            found[what] = "no error"
        except RuntimeError as exc:
            found[what] = str(exc)
    found["again"] = str(tuple(engine(torch.randn(2, 4)).shape))  # the engine still runs
    engine.close()
    return found


def test_zero3_names_a_submodule_called_with_its_parameters_freed(pool) -> None:
    for found in pool.run(_direct_calls):
        assert found["unit"] == "(2, 4)" and found["again"] == "(2, 3)", found
        assert found["head"].startswith("zero3: engine.module.head "), found["head"]
        assert_line_names(found["head"], "freed", "(head.weight")
        assert_line_names(found["head"], "root unit", "engine(...)")
        assert "strategy='zero2'" in found["head"] and "mat2" not in found["head"]
        assert found["inside"].startswith("zero3: engine.module.blocks.1.0 "), found
        assert_line_names(found["inside"], "unit engine.module.blocks.1", "its forward")


def _regulariser_over_all_parameters() -> dict[str, object]:
    """A loss term over every parameter, computed after the forward returned: under zero3 the
    parameters are empty there. Then a plain step, to see the engine recover."""
    torch.manual_seed(0)
    engine = dspark.Engine(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), optimizer=ADAMW,
                           strategy="zero3")
    x = dspark.distribute_batch(torch.randn(4, 4), shard_dim=0)
    out = engine(x)
    reg = sum(p.pow(2).sum() for p in engine.module.parameters())
    try:
        engine.backward(out.square().mean() + 1e-3 * reg)
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    engine.backward(engine(x).square().mean())
    recovered = engine.step()
    engine.close()
    return {"message": message, "value": float(reg), "recovered": recovered}


def test_zero3_explains_a_loss_term_over_parameters_outside_their_units(pool) -> None:
    for got in pool.run(_regulariser_over_all_parameters):
        message = str(got["message"])
        assert_names(message, "[DSpark zero3]", "engine.module.parameters()")
        assert "weight_decay" in message and "strategy='zero2'" in message, message
        assert got["value"] == 0.0  # what the term read: nothing
        assert got["recovered"] is True  # the failed window left nothing behind


def _module_state_dict_under(strategy: str) -> dict[str, object]:
    """A loop written for one process saves ``model.state_dict()`` and loads one back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    engine = dspark.Engine(model, optimizer=ADAMW, strategy=strategy)
    x = dspark.distribute_batch(torch.randn(4, 4), shard_dim=0)
    engine.backward(engine(x).square().mean())
    engine.step()
    got: dict[str, object] = {}
    for what, call in (("save", lambda: engine.module.state_dict()),
                       ("save_child", lambda: engine.module[1].state_dict()),
                       ("load", lambda: engine.module.load_state_dict(plain))):
        try:
            call()
            got[what] = "no error"
        except RuntimeError as exc:
            got[what] = str(exc)
    full = engine.full_state_dict()  # the engine's own walks still work
    engine.load_full_state_dict(plain)
    got["full_keys"] = sorted(full)
    got["loaded"] = all(torch.equal(engine.full_state_dict()[k], v) for k, v in plain.items())
    engine.close()  # takes the guard off with the other hooks
    got["after_close"] = sorted(engine.module.state_dict())
    return got


def test_zero3_refuses_the_modules_own_state_dict_and_names_the_fix(pool) -> None:
    for rank, got in enumerate(pool.run(_module_state_dict_under, "zero3")):
        for what, names in (("save", "0.weight, 0.bias, 1.0.weight, 1.0.bias and 2 more"),
                            ("save_child", "0.weight, 0.bias, 1.weight, 1.bias")):
            message = str(got[what])
            assert message.startswith(f"rank {rank}: state_dict() "), message
            assert_names(message, "strategy='zero3'")
            assert f"freed ({names})" in message, message
            assert "engine.full_state_dict(rank0_only=True, cpu=True)" in message
            assert "engine.save(path" in message and "strategy='zero2'" in message
        assert_line_names(str(got["load"]), "load_state_dict()", "strategy='zero3'")
        assert "engine.load_full_state_dict(sd)" in str(got["load"])
        assert got["full_keys"] == ["0.bias", "0.weight", "1.0.bias", "1.0.weight", "1.1.bias", "1.1.weight"]
        assert got["loaded"] is True
        assert got["after_close"] == got["full_keys"]


def test_zero2_keeps_the_modules_state_dict(pool) -> None:
    for got in pool.run(_module_state_dict_under, "zero2"):
        assert got["save"] == got["save_child"] == got["load"] == "no error"


def _evaluation_on_rank_0_only() -> dict[str, object]:
    """nanoGPT's ``if master_process: estimate_loss()``: under zero3 rank 0's evaluation forward
    would pair its gathers with rank 1's training forward."""
    torch.manual_seed(0)
    engine = dspark.Engine(tm.TinyMLP(), optimizer=ADAMW, strategy="zero3")
    x = dspark.distribute_batch(torch.randn(4, 6), shard_dim=0)
    try:
        if dspark.get_world().rank == 0:
            with torch.no_grad():
                engine(x)
        engine.backward(engine(x).square().mean())
        message = "no error"
    except dspark.CollectiveError as exc:
        message = str(exc)
    engine.backward(engine(x).square().mean())  # both ranks raised at the same gather: in step again
    recovered = engine.step()
    engine.close()
    return {"message": message, "recovered": recovered}


def test_zero3_names_an_evaluation_that_ran_on_one_rank_only(pool) -> None:
    got = run_or_explain_hang(pool, _evaluation_on_rank_0_only, timeout_s=60,
                              hang_means="the ranks' gathers paired up wrongly and nobody noticed")
    for rank, result in enumerate(got):
        message = str(result["message"])
        assert message.startswith(f"rank {rank}: "), message
        assert_line_names(message, "zero3", "gathered different parameters")
        mine, theirs = (("a forward without grad", "a training forward") if rank == 0
                        else ("a training forward", "a forward without grad"))
        assert_line_names(message, "this rank", "scale", mine)
        assert_line_names(message, f"rank {1 - rank}", "scale", theirs)
        assert "not on rank 0 alone" in message and "engine.full_state_dict()" in message
        assert_names(message, "an evaluation on some ranks only", "if master_process")
        # the evaluation's fix comes first, before the advice for a unit skipped in training
        assert message.index("not on rank 0 alone") < message.index("LayerDrop")
        assert result["recovered"] is True


def _optimizer_state_saved_on_rank_0(strategy: str, path: str) -> dict[str, object]:
    """A loop written for DDP saves ``optimizer.state_dict()`` on rank 0 (nanoGPT's checkpoint) and
    loads a saved one on every rank; under zero1-3 each rank's optimizer holds only its rows."""
    world = dspark.get_world()
    torch.manual_seed(0)
    engine = dspark.Engine(tm.TinyMLP(), optimizer=ADAMW, strategy=strategy)
    x = dspark.distribute_batch(torch.randn(4, 6), shard_dim=0)
    engine.backward(engine(x).square().mean())
    engine.step()
    got: dict[str, object] = {"saved": "nothing"}
    if world.rank == 0:  # `if master_process:`
        try:
            torch.save({"optimizer": engine.optimizer.state_dict()}, path)
            got["saved"] = "a file"
        except dspark.errors.ShardedOptimizerStateError as exc:
            got["saved"] = str(exc)
    plain = torch.optim.AdamW(tm.TinyMLP().parameters()).state_dict()  # one process's, as DDP saves
    try:
        engine.optimizer.load_state_dict(plain)
        got["loaded"] = "no error"
    except dspark.errors.ShardedOptimizerStateError as exc:
        got["loaded"] = str(exc)
    engine.save(path + ".ckpt")  # the fix the messages name, and the engine's own load through the guard
    engine.load(path + ".ckpt")
    got["resumed"] = engine.step_count
    engine.close()
    return got


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_sharded_optimizers_own_state_dict_is_refused_with_the_fix(pool, tmp_path, strategy: str) -> None:
    r0, r1 = pool.run(_optimizer_state_saved_on_rank_0, strategy, str(tmp_path / "optimizer.pt"))
    assert not (tmp_path / "optimizer.pt").exists() and r1["saved"] == "nothing"
    saved = str(r0["saved"])
    assert saved.startswith("rank 0: "), saved
    assert_names(saved, "optimizer.state_dict()", f"strategy={strategy!r} on 2 ranks", "rank 0's rows",
                 "engine.save(path", "engine.load(path)")
    for rank, result in enumerate((r0, r1)):
        loaded = str(result["loaded"])
        assert loaded.startswith(f"rank {rank}: "), loaded
        assert_names(loaded, "optimizer.load_state_dict()", f"strategy={strategy!r}", "engine.load(path)")
        assert result["resumed"] == 1


def _replicated_optimizer_state_dict() -> int:
    engine = dspark.Engine(tm.TinyMLP(), optimizer=ADAMW, strategy="replicate")
    engine.backward(engine(dspark.distribute_batch(torch.randn(4, 6), shard_dim=0)).square().mean())
    engine.step()
    state = engine.optimizer.state_dict()
    engine.optimizer.load_state_dict(state)
    engine.close()
    return sum(v.numel() for s in state["state"].values() for v in s.values())


def test_a_replicated_optimizer_keeps_pytorchs_state_dict(pool) -> None:
    whole = sum(2 * p.numel() + 1 for p in tm.TinyMLP().parameters())  # exp_avg, exp_avg_sq, step
    assert pool.run(_replicated_optimizer_state_dict) == [whole, whole]


def _deferred_tag_checks() -> dict[str, object]:
    """The accelerator's way (tags checked in batches, at the end of backward), run on CPU: a clean
    step leaves nothing pending, and a mismatched batch of tags names both sides."""
    torch.manual_seed(0)
    engine = dspark.Engine(tm.TinyMLP(), optimizer=ADAMW, strategy="zero3")
    scheduler = engine_parts(engine).zero3
    assert scheduler is not None and scheduler.tags.defer is False  # CPU parameters
    scheduler.tags.defer = True
    x = dspark.distribute_batch(torch.randn(4, 6), shard_dim=0)
    engine(x)  # a forward alone: its tags wait
    pending = len(scheduler.tags.deferred)
    engine.backward(engine(x).square().mean())
    engine.step()
    left = len(scheduler.tags.deferred)
    forward_tag = (1 << 48) | (0 << 24) | 0  # a training forward of the first parameter
    no_grad_tag = (2 << 48) | (0 << 24) | 0
    scheduler.tags.deferred = [(forward_tag, torch.tensor([forward_tag, no_grad_tag]))]
    try:
        scheduler.tags.verify_deferred()
        message = "no error"
    except dspark.CollectiveError as exc:
        message = str(exc)
    engine.close()
    return {"pending": pending, "left": left, "message": message}


def test_zero3_deferred_tag_checks_wait_for_backward_and_name_the_mismatch(pool) -> None:
    for result in pool.run(_deferred_tag_checks):
        assert result["pending"] > 0 and result["left"] == 0, result
        message = str(result["message"])
        assert_line_names(message, "scale", "a training forward", "rank 1", "scale", "a forward without grad")


class _FactoredSGD(torch.optim.Optimizer):
    """An optimizer of the user's own whose state is shaped unlike its parameter (a row statistic, as
    Adafactor keeps): sharded by rows, the statistic would be a shard's, not the parameter's."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.dim() == 2:
                        self.state[p]["row"] = p.grad.square().mean(1, keepdim=True)
                    p.add_(p.grad, alpha=-group["lr"])


def _sharded_with(optimizer_name: str, strategy: str) -> str:
    factory = {"Adafactor": functools.partial(torch.optim.Adafactor, lr=1e-2),
               "factored": _FactoredSGD}[optimizer_name]
    try:
        engine = dspark.Engine(tm.make("mlp"), optimizer=factory, strategy=strategy)
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, 0), shard_dim=0)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
        engine.close()
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("optimizer_name", ["Adafactor", "factored"])
def test_an_optimizer_that_is_not_element_wise_is_refused_where_state_is_sharded(pool, optimizer_name: str) -> None:
    """torch.optim.Adafactor under zero2 on 2 ranks ended 2.6e-3 away from one process (its row and
    column statistics computed per shard), and a checkpoint resharded its row statistics as if they
    were parameter rows. Refused at construction when the optimizer is known, after its first step
    when its state shows it; replicate keeps it."""
    for message in pool.run(_sharded_with, optimizer_name, "zero2"):
        assert_line_names(message, "strategy='zero2'", "optimizer state", "rows")
        assert "strategy='replicate'" in message
    assert pool.run(_sharded_with, optimizer_name, "replicate") == ["no error"] * 2


def _factory_over_model_parameters(strategy: str) -> str:
    torch.manual_seed(0)
    model = tm.TinyMLP()
    try:
        engine = dspark.Engine(model, optimizer=lambda params: torch.optim.SGD(model.parameters(), lr=0.1),
                               strategy=strategy)
    except ValueError as exc:
        return str(exc)
    engine.close()
    return "no error"


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_an_optimizer_factory_over_model_parameters_is_refused_where_rows_are_sharded(pool, strategy: str) -> None:
    """Such a factory ignored the engine's shards: zero2 and zero3 trained nothing and said nothing."""
    for message in pool.run(_factory_over_model_parameters, strategy):
        assert "it was not given" in message and "model.parameters()" in message, message


def test_an_optimizer_factory_over_the_same_parameters_is_fine_under_replicate(pool) -> None:
    assert pool.run(_factory_over_model_parameters, "replicate") == ["no error"] * 2


def test_sync_batchnorm_on_cpu_is_refused_with_the_engines_option(single_process) -> None:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    with pytest.raises(ValueError) as caught:
        dspark.Engine(model, optimizer=ADAMW)
    assert_names(str(caught.value), "module '1'", "nn.SyncBatchNorm", "sync_batchnorm=True")


def test_a_second_backward_through_one_graph_names_the_fix(single_process) -> None:
    engine = dspark.Engine(tm.TinyMLP(), optimizer=ADAMW, grad_accum_steps=2)
    out = engine(torch.randn(4, 6))
    engine.backward(out.square().mean())
    with pytest.raises(RuntimeError, match=r"engine.backward\(loss_a \+ loss_b\)"):
        engine.backward(out.abs().mean())


class _FailsOnRequest(nn.Module):
    """Two blocks and a head; its forward raises the user's own ValueError between the blocks
    while ``fail`` is set (a bad input found mid-forward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        if self.fail:
            raise ValueError("bad input")
        return self.head(self.blocks[1](x))


def _steps_after_a_failed_forward(fail_first: bool) -> dict[str, torch.Tensor]:
    model = _FailsOnRequest()
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="zero3")
    g = torch.Generator().manual_seed(dspark.get_world().rank)
    if fail_first:
        model.fail = True
        with pytest.raises(ValueError, match="bad input"):
            engine(torch.randn(4, 8, generator=g))
        model.fail = False
    for _ in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + dspark.get_world().rank))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def test_zero3_trains_on_after_a_forward_that_raised_the_users_own_error(pool) -> None:
    # any exception in a forward, not only a RuntimeError, leaves no unit half-gathered: the
    # steps after it equal those of a run where it never happened
    clean = pool.run(_steps_after_a_failed_forward, False)
    after = pool.run(_steps_after_a_failed_forward, True)
    for name, value in clean[0].items():
        assert torch.equal(after[0][name], value), name
