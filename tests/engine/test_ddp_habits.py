"""Lines kept from a DDP loop, caught where they run (or honoured exactly), under every strategy."""

from __future__ import annotations

import functools

import pytest
import torch

import dspark
from tests.engine import tiny_models as tm
from tests.messages import assert_names

SGD = functools.partial(torch.optim.SGD, lr=0.2)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = tm.batch("mlp", 8, step)
    return dspark.distribute_batch((x, y), shard_dim=0)


def _loss(engine: dspark.Engine, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return tm.loss_fn("mlp", engine(x), y)


def _divided_loss(strategy: str, allow: bool) -> dict[str, object]:
    """nanoGPT's ``loss = loss / gradient_accumulation_steps`` in the spellings dspark check once
    missed; then, refused with nothing changed, the same engine trains on."""
    gradient_accumulation_steps = 2

    def scaled(loss: torch.Tensor, k: int = gradient_accumulation_steps) -> torch.Tensor:
        return loss * k ** -1

    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy=strategy,
                           grad_accum_steps=gradient_accumulation_steps, allow_accum_scaled_loss=allow)
    before = engine.full_state_dict()
    spellings = {"div_": lambda loss: loss.div_(gradient_accumulation_steps),
                 "mul_": lambda loss: loss.mul_(1.0 / gradient_accumulation_steps),
                 "helper": scaled}
    messages = {}
    for name, spell in spellings.items():
        try:
            engine.backward(spell(_loss(engine, 0)))
            messages[name] = "no error"
            break  # allowed: the window is under way
        except ValueError as exc:
            messages[name] = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    for micro in range(2 - (1 if allow else 0)):
        engine.backward(_loss(engine, micro))
    applied = engine.step()
    engine.close()
    return {"messages": messages, "unchanged": unchanged, "applied": applied}


def test_a_loss_divided_by_the_accumulation_count_is_refused_in_every_spelling(pool, strategy: str) -> None:
    for rank, result in enumerate(pool.run(_divided_loss, strategy, False)):
        assert result["unchanged"] and result["applied"], result
        for spelling, message in result["messages"].items():
            assert message.startswith(f"rank {rank}: "), (spelling, message)
            assert_names(message, "divided by grad_accum_steps=2", "engine.backward(loss)",
                         "allow_accum_scaled_loss=True")


def test_allow_accum_scaled_loss_lets_a_scaled_loss_through(pool) -> None:
    for result in pool.run(_divided_loss, "zero2", True):
        assert result["messages"] == {"div_": "no error"} and result["applied"]


def _one_rank_changes(strategy: str, group: int, key: str, value: object, **options: object) -> dict[str, object]:
    """At step 1, rank 1 alone changes one hyper-parameter of one param group; both ranks change
    ``lr`` alike first (a schedule), which is no difference."""
    world = dspark.get_world()
    adamw = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    engine = dspark.Engine(tm.make("mlp"), optimizer=adamw, strategy=strategy,
                           param_groups=lambda name, p: {"weight_decay": 0.0} if p.ndim < 2 else {}, **options)
    engine.backward(_loss(engine, 0))
    engine.step()
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.005  # every rank: a schedule
    if world.rank == 1:
        engine.optimizer.param_groups[group][key] = value
    after_step_1 = engine.full_state_dict()
    try:
        engine.backward(_loss(engine, 1))
        engine.step()
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    unchanged = all(torch.equal(after_step_1[k], v) for k, v in engine.full_state_dict().items())
    engine.close()
    return {"message": message, "unchanged": unchanged, "step_count": engine.step_count}


@pytest.mark.parametrize(("group", "key", "value", "named"), [
    (0, "lr", 1.0, ("param group 0 'lr'", "0.005 on rank 0", "1.0 on rank 1")),
    (1, "betas", (0.8, 0.99), ("param group 1 'betas'", "(0.9, 0.999) on rank 0", "(0.8, 0.99) on rank 1")),
])
def test_a_hyperparameter_set_on_one_rank_stops_every_rank(pool, strategy: str, group: int, key: str,
                                                           value: object, named: tuple[str, ...]) -> None:
    for rank, result in enumerate(pool.run(_one_rank_changes, strategy, group, key, value)):
        message = str(result["message"])
        assert message.startswith(f"rank {rank}: "), message
        assert_names(message, "different hyper-parameters", *named, "on every rank")
        assert result["unchanged"] and result["step_count"] == 1, result


def _module_clip_in_the_loop(strategy: str, optimizer: str) -> dict[str, object]:
    """DDP's ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` between the window's last
    backward and the step, on the engine's module."""
    from tests.engine.cases import get_case
    from tests.engine.harness import build_engine, micro_batches

    case = get_case("mlp")
    engine = build_engine("mlp", strategy, optimizer=optimizer, accum=2)
    norms, message = [], "no error"
    for step in range(3):
        for micro in micro_batches(case.batch(step), 2):
            engine.backward(case.loss(engine, dspark.distribute_batch(micro, shard_dim=0)))
        try:
            norms.append(float(torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 0.05)))
        except dspark.errors.ShardedGradError as exc:
            message = str(exc)
            norms.append(engine.clip_grad_norm_(0.05))  # the fix the message names
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return {"state": state, "norms": norms, "message": message}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_clip_of_the_modules_parameters_clips_as_one_process_or_is_refused(pool, strategy: str,
                                                                           optimizer: str) -> None:
    from tests.engine.harness import assert_close, train_reference

    want = train_reference("mlp", 3, optimizer=optimizer, accum=2, clip=0.05)
    for rank, result in enumerate(pool.run(_module_clip_in_the_loop, strategy, optimizer)):
        assert result["norms"] == pytest.approx(want["norms"], rel=1e-6)
        assert all(n > 0.05 for n in result["norms"])  # it really clipped
        assert_close(result["state"], want["state"], f"{strategy} + {optimizer}: the module's clip")
        message = str(result["message"])
        if strategy in ("replicate", "zero1"):  # the module holds the whole reduced gradient
            assert message == "no error", message
        else:
            assert message.startswith(f"rank {rank}: "), message
            assert_names(message, "on the gradient of ", f"strategy={strategy!r}", "would clip nothing",
                         "clip_grad_norm=c", "engine.clip_grad_norm_(c)")


def test_a_sharded_gradient_reads_like_a_gradient_and_step_clears_it(single_process) -> None:
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy="zero2")
    x, y = tm.batch("mlp", 4, 0)
    engine.backward(tm.loss_fn("mlp", engine(x), y))
    weight = engine.module.layers[0].weight
    assert weight.grad is not None and weight.grad.shape == weight.shape and weight.grad.dtype == weight.dtype
    with pytest.raises(dspark.errors.ShardedGradError) as caught:
        weight.grad.norm()
    assert_names(str(caught.value), "norm()", "layers.0.weight")
    engine.step()
    assert weight.grad is None
    engine.close()


def test_the_engine_names_the_model_attribute_a_ddp_line_asked_it_for(single_process) -> None:
    # model = dspark.Engine(model, ...) in place of model = DDP(model): the loop's kept lines reach the engine
    engine = dspark.Engine(tm.make("mlp"), optimizer=SGD, strategy="zero2")
    with pytest.raises(AttributeError) as clip:
        torch.nn.utils.clip_grad_norm_(engine.parameters(), 1.0)   # nanoGPT's clip, kept
    assert_names(str(clip.value), "'parameters'", "engine.module.parameters()", "clip_grad_norm=c",
                 "engine.clip_grad_norm_(c)")
    with pytest.raises(AttributeError) as no_sync:
        engine.no_sync()
    assert_names(str(no_sync.value), "'no_sync'", "grad_accum_steps=K", "engine.backward(loss)")
    with pytest.raises(AttributeError) as saved:
        engine.state_dict()
    assert_names(str(saved.value), "engine.full_state_dict()", "engine.save(path)")
    with pytest.raises(AttributeError) as layer:
        _ = engine.layers   # any other attribute of the model
    assert_names(str(layer.value), "'layers'", "engine.module.layers")
    assert not hasattr(engine, "parameters") and not hasattr(engine, "no_such_thing")
    with pytest.raises(AttributeError) as private:
        _ = engine._no_such_thing
    assert str(private.value) == "'Engine' object has no attribute '_no_such_thing'"
    engine.close()
