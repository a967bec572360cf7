from __future__ import annotations

import re

import pytest
import torch

from dspark.models import synthetic_images, synthetic_tokens


def test_images_shapes_dtypes_and_label_range() -> None:
    images, labels = synthetic_images(6, image_size=20, num_classes=5, seed=0, dtype=torch.bfloat16)
    assert images.shape == (6, 3, 20, 20) and images.dtype == torch.bfloat16
    assert labels.shape == (6,) and labels.dtype == torch.int64
    assert 0 <= int(labels.min()) and int(labels.max()) < 5


def test_images_are_deterministic_from_the_seed() -> None:
    a = synthetic_images(4, image_size=8, num_classes=10, seed=3)
    b = synthetic_images(4, image_size=8, num_classes=10, seed=3)
    c = synthetic_images(4, image_size=8, num_classes=10, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_images_carry_a_per_class_pattern_shared_across_seeds() -> None:
    # The class template is fixed: averaging many images of one class, from two different seeds,
    # gives the same pattern (noise averages out), and another class gives another pattern.
    def class_mean(seed: int, label: int) -> torch.Tensor:
        images, labels = synthetic_images(512, image_size=8, num_classes=2, seed=seed)
        return images[labels == label].mean(0)

    a0, b0, a1 = class_mean(0, 0), class_mean(1, 0), class_mean(0, 1)
    assert (a0 - b0).abs().mean() < 0.2 < (a0 - a1).abs().mean()


def test_tokens_targets_are_the_next_tokens() -> None:
    tokens, targets = synthetic_tokens(3, seq_len=9, vocab_size=100, seed=0)
    assert tokens.shape == targets.shape == (3, 9)
    assert tokens.dtype == targets.dtype == torch.int64
    torch.testing.assert_close(tokens[:, 1:], targets[:, :-1])
    assert 0 <= int(tokens.min()) and int(torch.cat([tokens, targets]).max()) < 100


def test_tokens_are_deterministic_from_the_seed() -> None:
    a = synthetic_tokens(2, seq_len=32, vocab_size=1000, seed=7)
    b = synthetic_tokens(2, seq_len=32, vocab_size=1000, seed=7)
    c = synthetic_tokens(2, seq_len=32, vocab_size=1000, seed=8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_every_other_next_token_follows_one_fixed_successor_map() -> None:
    successor: dict[int, int] = {}
    for seed in range(3):
        tokens, targets = synthetic_tokens(4, seq_len=64, vocab_size=50, seed=seed)
        for w, nxt in zip(tokens[:, 0::2].flatten().tolist(), targets[:, 0::2].flatten().tolist(),
                          strict=True):
            assert successor.setdefault(w, nxt) == nxt
    # Odd positions are fresh draws: they do not follow the map (with 50 tokens, some must differ).
    tokens, targets = synthetic_tokens(4, seq_len=64, vocab_size=50, seed=9)
    odd = zip(tokens[:, 1::2].flatten().tolist(), targets[:, 1::2].flatten().tolist(), strict=True)
    assert any(successor.get(w, nxt) != nxt for w, nxt in odd)
    assert len(successor) > 40  # the map was really exercised


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_batch_size_is_rejected_with_the_value(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape(f"batch_size={bad!r}")):
        synthetic_tokens(bad, seq_len=4, vocab_size=10, seed=0)  # type: ignore[arg-type]


def test_seed_must_be_an_int() -> None:
    with pytest.raises(TypeError, match=r"seed=1\.5"):
        synthetic_images(2, image_size=4, num_classes=2, seed=1.5)  # type: ignore[arg-type]
