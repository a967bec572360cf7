"""peft models on 2 ranks, every strategy, built on the CPU or under ``dspark.meta_init()``: the base
model's own file fills the base weights with no key_map, and the LoRA weights keep their
initialisation (equal, bitwise, to from_pretrained then get_peft_model on the CPU); the adapter saved
is what ``PeftModel.from_pretrained`` loads and the merged model what ``from_pretrained`` loads, with
the engine's logits; what cannot be saved or loaded faithfully is refused on every rank."""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.checkpoint.hf_files import SafetensorsSource
from tests.engine import hf_models
from tests.messages import assert_names

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2)
PROBE = torch.arange(2 * hf_models.SEQ).reshape(2, hf_models.SEQ) % hf_models.VOCAB
BUILDERS = {"llama": hf_models.llama, "gpt2": hf_models.gpt2}
LORA_SEED = 1


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each base model saved by transformers, with other weights than any seed the tests build."""
    out = {}
    for name, build in BUILDERS.items():
        out[name] = str(tmp_path_factory.mktemp("base") / name)
        build(seed=5).save_pretrained(out[name])
    return out


def _from_pretrained_then_lora(model: str, base_dir: str) -> Any:
    """What a user writes on one CPU: the base model from its files, then peft, the generator where a
    build of the base model from its config leaves it (as in the engine's tasks)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(LORA_SEED)
    BUILDERS[model](seed=None)
    with torch.random.fork_rng():
        base = AutoModelForCausalLM.from_pretrained(base_dir)
    return hf_models.lora(base)


def _round_trip(model: str, build: str, strategy: str, base_dir: str, out: str) -> dict[str, Any]:
    torch.manual_seed(LORA_SEED)
    with dspark.meta_init() if build == "meta" else contextlib.nullcontext():
        peft_model = hf_models.lora(BUILDERS[model](seed=None))
    engine = dspark.Engine(peft_model, optimizer=ADAMW, strategy=strategy, batch_check_every=None)
    keys = engine.load_pretrained(base_dir)
    loaded = engine.full_state_dict()
    x, _ = hf_models.token_batch(4, step=0)
    xl = dspark.distribute_batch(x, shard_dim=0)
    engine.backward(engine(input_ids=xl, labels=xl).loss)
    engine.step()
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=PROBE).logits
    engine.save_pretrained(f"{out}/adapter")
    engine.save_pretrained(f"{out}/merged", merged=True)
    engine.close()
    return {"keys": tuple(keys), "loaded": loaded, "logits": logits}


@pytest.mark.parametrize("model,build,strategy", [
    *[("llama", build, strategy) for build in ("cpu", "meta")
      for strategy in ("replicate", "zero1", "zero2", "zero3")],
    ("gpt2", "meta", "zero3"),  # a fused Conv1D projection (fan_in_fan_out) and a tied head
    ("gpt2", "cpu", "replicate"),  # the tied head frozen, with no slot outside zero3
])
def test_lora_loads_its_base_and_saves_what_peft_and_transformers_load(
        pool, base_dirs: dict[str, str], tmp_path: Path, model: str, build: str, strategy: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    results = pool.run(_round_trip, model, build, strategy, base_dirs[model], str(tmp_path))
    want = _from_pretrained_then_lora(model, base_dirs[model]).state_dict()
    for result in results:
        assert result["keys"] == ([], [])  # the adapter's own tensors are not "missing"
        assert result["loaded"].keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(result["loaded"][key], value), key

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert {p.name for p in adapter.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    assert not (adapter / "config.json").exists() and not (adapter / "model.safetensors").exists()
    names = list(SafetensorsSource(adapter / "adapter_model.safetensors").headers)
    assert names and all((n.startswith("base_model.model.") and "lora_" in n) or "lm_head" in n for n in names)
    assert not any("base_layer" in n or ".default." in n for n in names), names
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    assert not any("lora_" in n or "base_layer" in n for n in SafetensorsSource(merged).headers)

    with torch.no_grad():
        from_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dirs[model]),
                                                 adapter).eval()(input_ids=PROBE).logits
        from_merged = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=PROBE).logits
    for result in results:
        torch.testing.assert_close(from_adapter, result["logits"], rtol=0, atol=1e-6)
        torch.testing.assert_close(from_merged, result["logits"], rtol=0, atol=1e-5)


def _refusals(base_dir: str, out: str) -> dict[str, str]:
    from peft import LoraConfig, inject_adapter_in_model

    found: dict[str, str] = {}

    def refused(what: str, call: Any) -> None:
        try:
            call()
            found[what] = "no error"
        except ValueError as exc:
            found[what] = str(exc)

    dora = hf_models.lora(hf_models.llama(), use_dora=True)  # magnitudes from the weights it has now
    engine = dspark.Engine(dora, optimizer=ADAMW, strategy="zero3", batch_check_every=None)
    refused("dora", lambda: engine.load_pretrained(base_dir))
    engine.close()

    plain = dspark.Engine(hf_models.llama(), optimizer=ADAMW, strategy="zero3", batch_check_every=None)
    refused("plain", lambda: plain.save_pretrained(f"{out}/plain", merged=True))
    plain.close()

    tied_head = hf_models.lora(hf_models.gpt2(), modules_to_save=["lm_head"])
    engine = dspark.Engine(tied_head, optimizer=ADAMW, strategy="zero3", batch_check_every=None)
    refused("tied", lambda: engine.save_pretrained(f"{out}/tied", merged=True))
    engine.close()

    injected = inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj"]), hf_models.llama())
    engine = dspark.Engine(injected, optimizer=ADAMW, strategy="zero3", batch_check_every=None)
    refused("injected", lambda: engine.save_pretrained(f"{out}/injected"))
    engine.close()
    return found


def test_what_cannot_be_saved_or_loaded_faithfully_is_refused_on_every_rank(
        pool, base_dirs: dict[str, str], tmp_path: Path) -> None:
    for found in pool.run(_refusals, base_dirs["llama"], str(tmp_path)):
        assert_names(found["dora"], "'default'", "use_dora=True", "get_peft_model")
        assert_names(found["plain"], "merged=True", "LlamaForCausalLM")
        assert_names(found["injected"], "peft.PeftModel", "get_peft_model", "merged=True")
        assert_names(found["tied"], "'lm_head.weight'", "'transformer.wte.weight'", "merged=False")
    assert not any((tmp_path / name).exists() for name in ("injected", "plain", "tied"))


def test_every_tensor_of_a_peft_model_has_its_base_name_or_is_the_adapters() -> None:
    from dspark.engine.adapters import adapter_layout

    model = hf_models.lora(hf_models.llama())
    layout = adapter_layout(model, model.state_dict())
    assert layout is not None and layout.is_peft_model
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert layout.base_name[f"{q}.base_layer.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert layout.base_name["base_model.model.model.norm.weight"] == "model.norm.weight"
    assert {f"{q}.lora_A.default.weight", f"{q}.lora_B.default.weight"} <= layout.adapter
    assert layout.sources()["lm_head.weight"] == ["base_model.model.lm_head.original_module.weight",
                                                  "base_model.model.lm_head.modules_to_save.default.weight"]
    assert layout.copies == {"base_model.model.lm_head.modules_to_save.default.weight": "lm_head.weight"}
    base = set(hf_models.llama().state_dict())
    assert set(layout.base_name.values()) == base
    assert adapter_layout(hf_models.llama(), hf_models.llama().state_dict()) is None
