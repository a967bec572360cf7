"""HuggingFace's generate() on a zero3 engine's module, 2 ranks, when one rank's prompt reaches its
end token first: every rank gets plain PyTorch's tokens with no flag from the user (the engine makes
synced_gpus default to True, see [Note: generation under zero3]). It used to leave the other rank's
next gather without a partner (a CollectiveError)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import dspark
from tests.engine import hf_models

PROMPT_LENGTH = 4
NEW_TOKENS = 6


def _generate(model_name: str) -> dict[str, object]:
    rank = dspark.get_world().rank
    model = hf_models.gpt2(seed=0) if model_name == "gpt2" else hf_models.lora(hf_models.llama(seed=0))
    model.eval()
    plain = copy.deepcopy(model)
    prompt = torch.tensor([[3 + rank, 5, 7, 9]])
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        free = plain.generate(input_ids=prompt, eos_token_id=None, **options)[0, PROMPT_LENGTH:].tolist()
        # rank 0 ends at its second new token; rank 1's end token never comes
        eos = free[1] if rank == 0 else next(t for t in range(hf_models.VOCAB - 1, 0, -1) if t not in free)
        want = plain.generate(input_ids=prompt, eos_token_id=eos, **options)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1), strategy="zero3")
    with torch.no_grad():
        got = engine.module.generate(input_ids=prompt, eos_token_id=eos, **options)
    engine.close()
    return {"got": got, "want": want, "restored": "generate" not in vars(model)}


@pytest.mark.parametrize("model", ["gpt2", "llama-lora"])
def test_generate_with_early_end_on_one_rank_gives_plain_tokens(pool, model: str) -> None:
    results = pool.run(_generate, model)
    assert results[0]["want"].shape[1] < PROMPT_LENGTH + NEW_TOKENS  # rank 0 stopped early...
    assert results[1]["want"].shape[1] == PROMPT_LENGTH + NEW_TOKENS  # ... rank 1 did not
    for result in results:
        assert torch.equal(result["got"], result["want"])
        assert result["restored"]  # engine.close() takes the default off the module
