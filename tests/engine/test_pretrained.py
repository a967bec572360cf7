"""Pretrained weights in and out on 2 ranks, every strategy: save_pretrained -> transformers'
from_pretrained gives the same logits; load_pretrained and load_full_state_dict(src_rank=0) give
full_state_dict() equal to the weights loaded; load(path, optimizer=False) takes weights only."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.checkpoint.hf_files import SafetensorsSource
from tests.engine import hf_models
from tests.messages import assert_line_names

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
SGD = functools.partial(torch.optim.SGD, lr=0.1)
PROBE = torch.arange(2 * hf_models.SEQ).reshape(2, hf_models.SEQ) % hf_models.VOCAB


def _engine(strategy: str, *, seed: int = 0, optimizer: Any = ADAMW) -> dspark.Engine:
    return dspark.Engine(hf_models.gpt2(seed=seed), optimizer=optimizer, strategy=strategy,
                         batch_check_every=None)


def _train_one_step(engine: dspark.Engine) -> None:
    x, y = hf_models.token_batch(4, step=0)
    xl, yl = dspark.distribute_batch((x, y), shard_dim=0)
    engine.backward(engine(input_ids=xl, labels=yl).loss)
    engine.step()


def _save(directory: str, strategy: str, max_shard_size: str) -> dict[str, Any]:
    engine = _engine(strategy)
    _train_one_step(engine)
    engine.save_pretrained(directory, max_shard_size=max_shard_size)
    engine.module.eval()
    with torch.no_grad():
        logits = engine(input_ids=PROBE).logits
    state = engine.full_state_dict()
    engine.close()
    return {"logits": logits, "state": state}


@pytest.mark.parametrize("strategy,max_shard_size", [("zero3", "5GB"), ("replicate", "3KB")])
def test_save_pretrained_loads_in_transformers_with_the_same_logits(pool, tmp_path: Path, strategy: str,
                                                                  max_shard_size: str) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    results = pool.run(_save, str(out), strategy, max_shard_size)
    sharded = max_shard_size != "5GB"
    assert (out / "model.safetensors.index.json").is_file() == sharded
    assert (out / "config.json").is_file()
    names = set(SafetensorsSource(out).headers)
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # tied: stored once
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    for key, value in model.state_dict().items():
        assert torch.equal(value, results[0]["state"][key]), key
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    for result in results:
        torch.testing.assert_close(logits, result["logits"], rtol=1e-5, atol=1e-6)


def _load_pretrained(directory: str, strategy: str) -> dict[str, torch.Tensor]:
    engine = _engine(strategy, seed=7)  # other weights than those saved: the load must replace them
    engine.load_pretrained(directory)
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.fixture(scope="module")
def saved_dir(pool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pretrained") / "hf"
    pool.run(_save, str(out), "zero3", "4KB")
    return out


def test_load_pretrained_gives_the_saved_weights(pool, saved_dir: Path, strategy: str) -> None:
    source = SafetensorsSource(saved_dir)
    for state in pool.run(_load_pretrained, str(saved_dir), strategy):
        for key, value in state.items():
            stored = "transformer.wte.weight" if key == "lm_head.weight" else key
            if stored in source.headers:
                assert torch.equal(value, source.read(stored)), key


def _load_mismatched(directory: str, strict: bool) -> Any:
    engine = _engine("zero3")
    try:
        return tuple(engine.load_pretrained(directory, strict=strict,
                                            key_map=lambda k: None if k.endswith("ln_f.bias") else
                                            k.replace("h.1.", "layer.1.")))
    except ValueError as exc:
        return str(exc)
    finally:
        engine.close()


def test_load_pretrained_lists_missing_and_unexpected_keys(pool, saved_dir: Path) -> None:
    for message in pool.run(_load_mismatched, str(saved_dir), True):
        assert "missing ['transformer.h.1.ln_1.weight'" in message, message
        assert "unexpected [" in message and "'transformer.layer.1.ln_1.weight'" in message, message
        assert "and 3 more" in message  # 13 missing (12 of block 1 and ln_f.bias), 10 listed
    for missing, unexpected in pool.run(_load_mismatched, str(saved_dir), False):
        assert "transformer.ln_f.bias" in missing and "transformer.h.1.mlp.c_fc.weight" in missing
        assert "transformer.layer.1.mlp.c_fc.weight" in unexpected


def _two_names_onto_one(directory: str) -> dict[str, Any]:
    engine = _engine("zero2")
    before = engine.full_state_dict()
    try:
        engine.load_pretrained(directory, key_map={"transformer.h.0.ln_1.weight": "transformer.h.0.ln_2.weight"})
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    unchanged = all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    engine.close()
    return {"message": message, "unchanged": unchanged}


def test_a_key_map_that_loads_two_tensors_into_one_is_refused(pool, saved_dir: Path) -> None:
    for result in pool.run(_two_names_onto_one, str(saved_dir)):
        assert_line_names(result["message"], "'transformer.h.0.ln_2.weight'", "'transformer.h.0.ln_1.weight'",
                          "'transformer.h.0.ln_2.weight'", "dropped")
        assert result["unchanged"], result


def _load_from_rank_0(strategy: str) -> dict[str, torch.Tensor]:
    source = hf_models.gpt2(seed=11).state_dict() if dspark.get_world().rank == 0 else None
    engine = _engine(strategy)
    engine.load_full_state_dict(source, src_rank=0)
    state = engine.full_state_dict()
    engine.close()
    return state


def test_load_full_state_dict_from_rank_0_only(pool, strategy: str) -> None:
    want = hf_models.gpt2(seed=11).state_dict()
    for state in pool.run(_load_from_rank_0, strategy):
        for key, value in want.items():
            assert torch.equal(state[key], value), key


def _load_from_rank_0_mis_shaped() -> str:
    source = None
    if dspark.get_world().rank == 0:
        source = hf_models.gpt2(seed=11).state_dict()
        source["transformer.h.0.attn.c_proj.weight"] = torch.zeros(3, 3)
    engine = _engine("zero3")
    try:
        engine.load_full_state_dict(source, src_rank=0)
    except ValueError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


def test_a_mis_shaped_tensor_on_the_source_rank_fails_every_rank(pool) -> None:
    for message in pool.run(_load_from_rank_0_mis_shaped):
        assert_line_names(message, "'transformer.h.0.attn.c_proj.weight'", "shape (3, 3)", "source")


def _weights_only(path: str) -> dict[str, Any]:
    saver = _engine("zero3", optimizer=ADAMW)
    _train_one_step(saver)
    saver.save(path)
    want = saver.full_state_dict()
    saver.close()
    other = _engine("zero2", seed=5, optimizer=SGD)  # another optimizer class: optimizer=True refuses
    other.load(path, optimizer=False)
    got = other.full_state_dict()
    step = other.step_count
    other.close()
    return {"same": all(torch.equal(got[k], want[k]) for k in want), "step": step}


def test_load_weights_only_into_an_engine_with_another_optimizer(pool, tmp_path: Path) -> None:
    for result in pool.run(_weights_only, str(tmp_path / "ckpt")):
        assert result == {"same": True, "step": 0}
    assert json.loads((tmp_path / "ckpt" / "dspark.json").read_text())["optimizer"] == "AdamW"


def _reads_under_zero3(directory: str) -> dict[str, Any]:
    from unittest import mock

    from dspark.checkpoint.hf_files import SafetensorsSource as Source

    calls: list[tuple[str, int | None, int | None]] = []
    original = Source.read

    def spy(self: Source, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        calls.append((name, start, stop))
        return original(self, name, start, stop)

    engine = _engine("zero3")
    with mock.patch.object(Source, "read", spy):
        engine.load_pretrained(directory)
    rows = {s.name: (s.start, s.stop) for s in engine.slots}
    engine.close()
    return {"calls": calls, "rows": rows}


def test_under_zero3_each_rank_reads_only_its_rows(pool, saved_dir: Path) -> None:
    results = pool.run(_reads_under_zero3, str(saved_dir))
    shapes = {name: h.shape for name, h in SafetensorsSource(saved_dir).headers.items()}
    for result in results:
        assert len(result["calls"]) == len(shapes)  # each stored tensor read once (the tie too)
        for name, start, stop in result["calls"]:
            if len(shapes[name]) > 0:
                assert (start, stop) == result["rows"][name], name
                assert stop - start < shapes[name][0], name  # never the whole tensor


def test_a_frozen_tied_weight_outside_zero3_is_one_entry_with_both_names() -> None:
    """A frozen parameter has no slot outside zero3; tied (GPT-2's head and embedding, frozen by peft
    or by hand), its two names are still one tensor: the file's one copy fills both, and a save writes
    it once."""
    from dspark.engine.weights import match_keys, weight_entries

    model = hf_models.gpt2()
    model.transformer.wte.weight.requires_grad_(False)
    entries = weight_entries([], model.state_dict(keep_vars=True))
    tied = [e.names for e in entries if "lm_head.weight" in e.names]
    assert tied == [("transformer.wte.weight", "lm_head.weight")]
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert match_keys(entries, shapes).missing == []
