"""An export loads where users load weights: a HuggingFace model's checkpoint keeps its config.json,
so ``from_pretrained`` of the exported directory gives the engine's logits; nanoGPT's own loader
(``sample.py``: ``torch.load``, ``GPT(GPTConfig(**checkpoint["model_args"]))``,
``load_state_dict(checkpoint["model"])``, strict) takes a ``.pt`` export with its tied head; a
``--all-names`` safetensors file loads strictly with ``load_state_dict(load_file(...))``."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.cli.main import main
from tests.engine import hf_models
from tests.engine.nanogpt_model import SEQ, NanoGPT

PROBE = torch.arange(2 * hf_models.SEQ).reshape(2, hf_models.SEQ) % hf_models.VOCAB
MODEL_ARGS = {"n_layer": 2}
BUILDERS = {"gpt2": hf_models.gpt2, "llama": hf_models.llama, "nanogpt": lambda: NanoGPT(**MODEL_ARGS),
            "llama-lora": lambda: hf_models.lora(hf_models.llama())}


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens) if isinstance(getattr(model, "module", model), NanoGPT) else model(input_ids=tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def _train_and_save(name: str, strategy: str, path: str) -> torch.Tensor:
    torch.manual_seed(0)
    engine = dspark.Engine(BUILDERS[name](), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy, batch_check_every=None)
    x, _ = hf_models.token_batch(4, step=0)
    x = dspark.distribute_batch(x[:, :SEQ], shard_dim=0)
    logits = _logits(engine, x)
    engine.backward(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()))
    engine.step()
    engine.save(path, extra={"model_args": dict(MODEL_ARGS)})
    engine.eval()
    with torch.no_grad():
        probe = _logits(engine, PROBE)
    engine.close()
    return probe


@pytest.mark.parametrize("name,strategy", [("gpt2", "zero3"), ("llama", "zero2")])
def test_a_directory_export_of_a_hf_model_loads_with_from_pretrained(pool, tmp_path: Path, name: str,
                                                                     strategy: str) -> None:
    from transformers import AutoModelForCausalLM

    results = pool.run(_train_and_save, name, strategy, str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "config.json").is_file()  # kept, and listed in the manifest
    assert main(["ckpt", "verify", str(tmp_path / "ckpt")]) == 0
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        logits = _logits(model, PROBE)
    for result in results:
        torch.testing.assert_close(logits, result, rtol=0, atol=1e-6)


def test_nanogpt_sample_py_loads_a_pt_export_and_all_names_safetensors(pool, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    results = pool.run(_train_and_save, "nanogpt", "zero3", str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "config.json").exists()
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "ckpt.pt"), "--extra", "model_args"]) == 0
    assert main(["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "all.safetensors"), "--all-names"]) == 0

    # nanoGPT's sample.py, as it reads its own ckpt.pt
    checkpoint = torch.load(tmp_path / "ckpt.pt", map_location="cpu")
    model = NanoGPT(**checkpoint["model_args"])
    model.load_state_dict(checkpoint["model"])  # strict: lm_head.weight is there, tied
    assert model.lm_head.weight is model.transformer.wte.weight
    plain = NanoGPT(**MODEL_ARGS)
    plain.load_state_dict(load_file(tmp_path / "all.safetensors"))
    for loaded in (model.eval(), plain.eval()):
        with torch.no_grad():
            torch.testing.assert_close(_logits(loaded, PROBE), results[0], rtol=0, atol=1e-6)


def test_a_peft_models_checkpoint_keeps_no_config(pool, tmp_path: Path) -> None:
    """Its names are peft's (base_model.model...): a config.json beside them would make the export
    look like a model transformers loads, with the weights under names it ignores."""
    pool.run(_train_and_save, "llama-lora", "zero3", str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "config.json").exists()
