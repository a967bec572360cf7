"""The engine behaves like the model where users expect it: ``train()`` / ``eval()`` / ``training`` as
on an nn.Module, ``engine(x)`` under the engine's precision and ``engine.module(x)`` without it, and
``engine.module`` generating text under every strategy (zero3: every rank generates alike)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import dspark
from tests.engine import loop_models as lm

SGD = functools.partial(torch.optim.SGD, lr=0.5)


def test_train_and_eval_switch_the_module_and_return_the_engine(single_process) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    engine = dspark.Engine(model, optimizer=SGD)
    assert engine.training and model.training
    assert engine.eval() is engine
    assert not engine.training and not model.training and not model[1].training
    assert engine.train() is engine and engine.training and model[1].training
    assert engine.train(False) is engine and not model.training
    engine.close()


def test_engine_call_runs_under_autocast_and_the_module_does_not(single_process) -> None:
    engine = dspark.Engine(nn.Linear(4, 4), optimizer=SGD, precision="bf16")
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert engine(x).dtype == torch.bfloat16
        assert engine.module(x).dtype == torch.float32
    engine.close()


def _greedy(model: nn.Module, prompt: torch.Tensor) -> list[list[int]]:
    tokens = prompt
    with torch.no_grad():
        while tokens.shape[1] < lm.SEQ:
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    return tokens.tolist()


def _generate(strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    engine = dspark.Engine(lm.LoopGPT(), optimizer=SGD, strategy=strategy)
    tokens = torch.randint(0, lm.VOCAB, (4, lm.SEQ), generator=torch.Generator().manual_seed(1))
    x = dspark.distribute_batch(tokens, shard_dim=0)
    logits = engine(x[:, :-1])
    engine.backward(nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()))
    engine.step()
    engine.eval()
    prompt = tokens[:2, :2]  # every rank generates for the same prompts, the same number of tokens
    generated = _greedy(engine.module, prompt)
    engine.train()
    plain = lm.LoopGPT()
    plain.load_state_dict(engine.full_state_dict())
    want = _greedy(plain.eval(), prompt)
    engine.close()
    return {"generated": generated, "want": want}


def test_the_module_generates_like_the_trained_model_under_every_strategy(pool, strategy: str) -> None:
    for rank, result in enumerate(pool.run(_generate, strategy)):
        assert result["generated"] == result["want"], (rank, strategy, result)
