from __future__ import annotations

import pytest
import torch

from dspark.models import GPT, GPTConfig, count_params
from tests.messages import assert_names

TINY = GPTConfig(vocab_size=50, context_len=16, num_layers=2, num_heads=2, width=16)


def test_gpt2_124m_has_exactly_124_439_808_parameters_tied_counted_once() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig())
    assert count_params(model) == 124_439_808
    # Untied, the head would add vocab * width more: the tie is what makes the count.
    assert sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False)) == 124_439_808 + 50257 * 768


def test_lm_head_is_the_token_embedding_same_storage() -> None:
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    with torch.no_grad():
        model.wte.weight[3, 5] = 42.0
    assert model.lm_head.weight[3, 5].item() == 42.0
    # One parameter: the optimizer and the gradient all-reduce see it once.
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names


def test_forward_shape() -> None:
    tokens = torch.randint(0, TINY.vocab_size, (3, 10))
    assert GPT(TINY)(tokens).shape == (3, 10, TINY.vocab_size)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    tokens = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8] = (tokens[0, 8] + 1) % TINY.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])   # the past does not see the future
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_sequence_longer_than_context_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"sequence length 17.*context_len=16"):
        GPT(TINY)(torch.zeros(1, 17, dtype=torch.long))


def test_width_must_divide_by_heads() -> None:
    with pytest.raises(ValueError) as caught:
        GPTConfig(width=10, num_heads=3)
    assert_names(str(caught.value), "width=10", "num_heads=3")


@pytest.mark.parametrize("name", ["vocab_size", "context_len", "num_layers", "num_heads", "width"])
def test_sizes_must_be_positive(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}=0"):
        GPTConfig(**{name: 0})  # type: ignore[arg-type]
