"""Synthetic batches shaped like ImageNet and like tokenised text, deterministic from a seed.

Every rank calls these with the same seed and gets the same *global* batch, which
:func:`dspark.distribute_batch` then splits; so N ranks see exactly the samples one rank would.
Numbers are drawn by a generator on the target device: the same (seed, device type) gives the
same batch, and a GPU batch never crosses the host bus.

The data is not pure noise: it carries a small fixed structure (the same for every seed), so a
model's loss keeps falling over fresh batches, as on real data, and a training bug that stops
learning shows up in a few steps.
- images: each class adds its own coarse pattern (a low-resolution template, upsampled) to
  Gaussian noise;
- text: tokens come in pairs ``(w, successor[w])`` with ``successor`` a fixed permutation of the
  vocabulary, so every other next-token is predictable from the current one (the best loss is
  about ``ln(vocab_size) / 2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["synthetic_images", "synthetic_tokens"]

# Seeds the fixed structure (class templates, token successors), never the samples: one
# "dataset" for every step, so what a model learns at step s still holds at step s + 1.
_DATASET_SEED = 0x5EED
_TEMPLATE_SIZE = 4      # class templates are 4x4 per channel, upsampled to the image size
_TEMPLATE_SCALE = 1.0   # template amplitude relative to the unit-variance noise


def _generator(seed: int, device: torch.device) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} must be an int")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


def synthetic_images(batch_size: int, *, image_size: int, num_classes: int, seed: int,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of images ``(B, C, H, W)`` in ``dtype`` and labels ``(B,)`` int64 in [0, num_classes).

    Example::

        images, labels = synthetic_images(8, image_size=224, num_classes=1000, seed=0)
        images.shape, labels.shape   # (torch.Size([8, 3, 224, 224]), torch.Size([8]))
    """
    _check_positive(batch_size=batch_size, image_size=image_size, num_classes=num_classes,
                    channels=channels)
    device = torch.device(device)
    structure = _generator(_DATASET_SEED, device)
    templates = torch.randn(num_classes, channels, _TEMPLATE_SIZE, _TEMPLATE_SIZE,
                            generator=structure, device=device)       # (K, C, 4, 4)
    gen = _generator(seed, device)
    labels = torch.randint(0, num_classes, (batch_size,), generator=gen, device=device)
    noise = torch.randn(batch_size, channels, image_size, image_size, generator=gen,
                        device=device)                                # (B, C, H, W)
    signal = F.interpolate(templates[labels], size=(image_size, image_size), mode="nearest")
    images = noise.add_(signal, alpha=_TEMPLATE_SCALE)
    return images.to(dtype), labels


def synthetic_tokens(batch_size: int, *, seq_len: int, vocab_size: int, seed: int,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, T)`` int64 and their next tokens ``(B, T)`` int64 (targets[:, t] = ids[:, t+1]).

    Example::

        tokens, targets = synthetic_tokens(4, seq_len=1024, vocab_size=50257, seed=0)
        bool((tokens[:, 1:] == targets[:, :-1]).all())   # True
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)
    device = torch.device(device)
    successor = torch.randperm(vocab_size, generator=_generator(_DATASET_SEED, device),
                               device=device)                         # (V,)
    num_pairs = (seq_len + 2) // 2  # enough pairs for seq_len + 1 tokens
    gen = _generator(seed, device)
    first = torch.randint(0, vocab_size, (batch_size, num_pairs), generator=gen,
                          device=device)                              # (B, P)
    pairs = torch.stack((first, successor[first]), dim=2)             # (B, P, 2)
    stream = pairs.view(batch_size, 2 * num_pairs)[:, : seq_len + 1]  # (B, T + 1)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
