"""What a failed save leaves behind (nothing new), and the errors a load gives: no checkpoint,
another model, a partial or damaged directory; on every rank, before anything is changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dspark.checkpoint import CheckpointError, CheckpointNotFoundError, read_checkpoint_info
from tests.checkpoint.ranks import (
    load_error,
    load_then_continue,
    make_engine,
    save_with_failing_rank,
    train,
)
from tests.messages import assert_line_names, assert_names


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_no_partial_dir(
        pool, single_process, two_rank_checkpoint: Path, copy: Path, failing_rank: int) -> None:
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    messages = pool.run(save_with_failing_rank, str(copy), failing_rank)
    for message in messages:  # every rank raised, naming the rank whose write failed
        assert_line_names(message, "failed", f"rank(s) [{failing_rank}]")
        assert_names(message, "No space left")
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert sorted(p.name for p in copy.parent.iterdir()) == ["ckpt"]  # the staging dir is gone
    assert load_then_continue(str(copy), "mlp", "replicate")["step_count"] == 2  # and it still loads


def test_a_save_replaces_the_old_checkpoint(single_process, copy: Path) -> None:
    assert read_checkpoint_info(copy).world_size == 2
    engine = make_engine("mlp", "zero1")
    train(engine, "mlp", range(1))
    engine.save(copy)
    info = read_checkpoint_info(copy)
    assert (info.world_size, info.strategy, info.step_count) == (1, "zero1", 1)
    assert sorted(p.name for p in copy.iterdir()) == [".metadata", "__0_0.distcp", "dspark.json",
                                                   "manifest.json", "training_state.json"]
    assert sorted(p.name for p in copy.parent.iterdir()) == ["ckpt"]


def test_a_save_refuses_to_replace_what_is_not_a_checkpoint(single_process, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as info:
        make_engine("mlp", "replicate").save(tmp_path)
    assert_names(str(info.value), f"path={str(tmp_path)!r}")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_save_and_load_only_between_steps(single_process, copy: Path) -> None:
    engine = make_engine("mlp", "zero2")
    x = torch.randn(4, 6)
    engine.backward(engine(x).square().mean())
    for call in (engine.save, engine.load):
        with pytest.raises(RuntimeError, match=r"1 of grad_accum_steps=1 backward\(\)"):
            call(copy)


def test_another_model_is_refused_on_every_rank_naming_the_first_differing_parameter(
        pool, two_rank_checkpoint: Path) -> None:
    for kind, message in pool.run(load_error, str(two_rank_checkpoint), "tied", "zero2"):
        assert kind == "CheckpointError"
        assert_line_names(message, "'embed.weight'", "(11, 6)", "not in the checkpoint")


def test_a_changed_shape_is_named(single_process, two_rank_checkpoint: Path, monkeypatch) -> None:
    from tests.engine import tiny_models as tm

    monkeypatch.setattr(tm.TinyMLP.__init__, "__defaults__", (6, 8, 3))  # hidden 7 -> 8
    kind, message = load_error(str(two_rank_checkpoint), "mlp", "replicate")
    assert kind == "CheckpointError"
    assert_line_names(message, "'layers.0.weight'", "(8, 6)", "model", "(7, 6)", "checkpoint")


def test_another_optimizer_is_refused_before_anything_changes(single_process, copy: Path) -> None:
    """The checkpoint holds AdamW's state and hyper-parameters (betas, eps); loaded into an SGD engine
    they replaced its groups and the next step failed on the missing 'momentum'."""
    import dspark
    from tests.engine import tiny_models as tm

    engine = dspark.Engine(tm.make("mlp"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    groups = [dict(g) for g in engine.optimizer.param_groups]
    with pytest.raises(CheckpointError) as info:
        engine.load(copy)
    assert_names(str(info.value), "AdamW", "SGD")
    assert str(copy) in str(info.value)
    assert [dict(g) for g in engine.optimizer.param_groups] == groups and engine.step_count == 0
    train(engine, "mlp", range(1))  # and it still trains


def test_no_checkpoint_at_the_path(single_process, tmp_path: Path) -> None:
    engine = make_engine("mlp", "replicate")
    with pytest.raises(CheckpointNotFoundError) as info:
        engine.load(tmp_path / "missing")
    assert_names(str(info.value), "missing")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    with pytest.raises(CheckpointNotFoundError, match=r"has no dspark\.json"):
        engine.load(tmp_path)
    with pytest.raises(TypeError) as caught:
        engine.load(3)  # type: ignore[arg-type]
    assert_names(str(caught.value), "path=3", "os.PathLike")


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "__1_0.distcp").unlink(), "partial checkpoint: shard file '__1_0.distcp' is missing"),
    (lambda d: (d / "__0_0.distcp").write_bytes(b"cut"), "shard file '__0_0.distcp' has 3 bytes"),
    (lambda d: (d / ".metadata").unlink(), "has no .metadata file"),
    (lambda d: (d / ".metadata").write_bytes(b"\x80garbage"), ".metadata' is damaged or not this checkpoint's"),
    (lambda d: (d / "dspark.json").write_text("{"), "dspark.json' is damaged"),
])
def test_partial_or_damaged_checkpoints_are_named(single_process, copy: Path, damage, message: str) -> None:
    damage(copy)
    engine = make_engine("mlp", "replicate")
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        engine.load(copy)
    assert message in str(info.value)
    after = engine.module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was changed


class _SavesOverOnFirstLoad:
    """An extra object whose first load_state_dict publishes another checkpoint at the same path,
    as a training job saving to ckpt/latest while an evaluator loads it."""

    def __init__(self, writer: Any, path: str) -> None:
        self.writer, self.path, self.loads, self.value = writer, path, 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loads += 1
        self.value = state["value"]
        if self.loads == 1:
            self.writer.save(self.path, extra={"probe": _Value(2)})


class _Value:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def test_a_checkpoint_replaced_while_it_is_loaded_is_loaded_again_whole(single_process, tmp_path: Path) -> None:
    """Files read before and after a publish came from two checkpoints: the step count of one and
    the weights of the next, without an error."""
    from tests.checkpoint.ranks import make_engine, train

    path = str(tmp_path / "latest")
    first = make_engine("mlp", "replicate")
    first.save(path, extra={"probe": _Value(1)})
    second = make_engine("mlp", "replicate", seed=1)
    train(second, "mlp", range(2))
    reader = make_engine("mlp", "replicate", seed=2)
    probe = _SavesOverOnFirstLoad(second, path)
    info = reader.load(path, extra={"probe": probe})
    assert probe.loads == 2 and probe.value == 2, "the load did not start again from the new checkpoint"
    assert info.step_count == second.step_count == reader.step_count
    want, got = second.full_state_dict(), reader.full_state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    for engine in (first, second, reader):
        engine.close()
