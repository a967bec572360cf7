"""What a benchmark workload is: a model, its synthetic data, its loss and its default config.

A :class:`Workload` is a frozen value. The two kinds, :class:`ImageClassification` (ResNet on
ImageNet-shaped images) and :class:`LanguageModeling` (GPT on token ids), share one interface, so
the benchmark runner and the examples never branch on the model::

    wl = get_workload("resnet50-cpu")
    model = wl.build_model(seed=0)
    inputs, targets = wl.make_batch(wl.default_global_batch, seed=step)
    loss = wl.loss(model(inputs), targets)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.data import synthetic_images, synthetic_tokens
from dspark.models.gpt import GPT, GPTConfig
from dspark.models.resnet import ResNet, ResNetConfig

__all__ = ["PRECISIONS", "ImageClassification", "LanguageModeling", "Workload", "count_params"]

PRECISIONS = ("fp32", "fp16", "bf16")


def count_params(model: nn.Module) -> int:
    """Parameters of ``model``, each tensor counted once (a tied weight is one tensor).

    Example::

        count_params(torch.nn.Linear(3, 2))   # 8
    """
    return sum(p.numel() for p in model.parameters())


def _build(make: type[nn.Module], config: object, *, seed: int, device: torch.device | str) -> nn.Module:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} must be an int")
    device = torch.device(device)
    if device.type == "meta":
        # Shapes only, no storage and no init cost: how the 124M model is counted in a blink.
        with torch.device("meta"):
            return make(config)
    # Built on the CPU under a private RNG: the same seed gives the same weights on any device
    # type, and the caller's global RNG stream is left exactly as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make(config)
    return model.to(device)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A named benchmark workload; use :func:`dspark.models.get_workload` to get one."""

    name: str
    """Registry name, e.g. ``"resnet50-cpu"``."""
    description: str
    """One line for listings and reports."""
    default_global_batch: int
    """Samples per optimizer step across all ranks (divisible by 2 and 4)."""
    default_precision: str
    """``"fp32"``, ``"fp16"`` or ``"bf16"``: the precision this workload is benchmarked in."""
    max_micro_batch: int | None = None
    """The most samples one rank runs in one forward/backward pass; a larger local batch runs as
    equal micro-batches whose gradients accumulate into one optimizer step (:meth:`passes`).
    ``None``: the local batch in one pass. Set where a step's batch does not fit one GPU at once."""

    def __post_init__(self) -> None:
        if self.default_precision not in PRECISIONS:
            raise ValueError(f"default_precision={self.default_precision!r} is not one of {PRECISIONS}")
        if self.max_micro_batch is not None and (isinstance(self.max_micro_batch, bool)
                                                 or self.max_micro_batch < 1):
            raise ValueError(f"max_micro_batch={self.max_micro_batch!r} must be None or an int >= 1")
        if self.default_global_batch < 1 or self.default_global_batch % 4:
            raise ValueError(f"default_global_batch={self.default_global_batch!r} must be a "
                             "positive multiple of 4 (so it splits over 1, 2 and 4 ranks)")

    def passes(self, local_batch: int) -> int:
        """Forward/backward passes per optimizer step for a rank holding ``local_batch`` samples:
        the fewest equal micro-batches of at most :attr:`max_micro_batch` samples (1 without a
        limit). Equal, so that each pass's mean loss weighs the same.

        Example::

            get_workload("gpt2-124m").passes(256)   # 8: micro-batches of 32
            get_workload("gpt2-124m").passes(48)    # 2: micro-batches of 24
        """
        if isinstance(local_batch, bool) or not isinstance(local_batch, int) or local_batch < 1:
            raise ValueError(f"local_batch={local_batch!r} must be an int >= 1")
        if self.max_micro_batch is None or local_batch <= self.max_micro_batch:
            return 1
        count = -(-local_batch // self.max_micro_batch)
        while local_batch % count:
            count += 1
        return count

    def build_model(self, *, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
        """A freshly initialised model, identical for the same seed (``device="meta"``: shapes only)."""
        raise NotImplementedError

    def make_batch(self, global_batch: int, *, seed: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` for one global batch, identical on every rank for the same seed."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the model's output against ``targets`` (a 0-d fp32 tensor)."""
        raise NotImplementedError

    @staticmethod
    def num_params(model: nn.Module) -> int:
        """Parameters of ``model``, a tied weight counted once (see :func:`count_params`)."""
        return count_params(model)


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageClassification(Workload):
    """A ResNet classifying ImageNet-shaped synthetic images.

    Example::

        wl = ImageClassification(name="tiny", description="", default_global_batch=8,
                                 default_precision="fp32", image_size=32,
                                 model=ResNetConfig(base_width=8, num_classes=10))
        images, labels = wl.make_batch(8, seed=0)    # (8, 3, 32, 32) float32, (8,) int64
    """

    model: ResNetConfig
    """The network's shape."""
    image_size: int
    """Images are square: ``(3, image_size, image_size)``."""

    def __post_init__(self) -> None:
        Workload.__post_init__(self)
        if self.image_size < 1:
            raise ValueError(f"image_size={self.image_size!r} must be >= 1")

    def build_model(self, *, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
        return _build(ResNet, self.model, seed=seed, device=device)

    def make_batch(self, global_batch: int, *, seed: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        return synthetic_images(global_batch, image_size=self.image_size,
                                num_classes=self.model.num_classes, seed=seed, device=device,
                                dtype=dtype, channels=self.model.in_channels)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # fp32 softmax whatever the autocast dtype: a bf16 log-sum-exp loses the small differences
        # between classes that the gradient is made of.
        return F.cross_entropy(output.float(), targets)  # output (B, K), targets (B,)


@dataclass(frozen=True, kw_only=True, slots=True)
class LanguageModeling(Workload):
    """A GPT predicting the next token of synthetic token sequences.

    Example::

        wl = LanguageModeling(name="tiny", description="", default_global_batch=4,
                              default_precision="fp32", seq_len=16,
                              model=GPTConfig(vocab_size=64, context_len=16, num_layers=1,
                                              num_heads=2, width=32))
        tokens, targets = wl.make_batch(4, seed=0)   # both (4, 16) int64
    """

    model: GPTConfig
    """The network's shape."""
    seq_len: int
    """Tokens per sample (at most ``model.context_len``)."""

    def __post_init__(self) -> None:
        Workload.__post_init__(self)
        if not 1 <= self.seq_len <= self.model.context_len:
            raise ValueError(f"seq_len={self.seq_len!r} must be in [1, context_len="
                             f"{self.model.context_len}]")

    def build_model(self, *, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
        return _build(GPT, self.model, seed=seed, device=device)

    def make_batch(self, global_batch: int, *, seed: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        # Token ids are int64 whatever the compute dtype; ``dtype`` is accepted for a uniform call.
        return synthetic_tokens(global_batch, seq_len=self.seq_len,
                                vocab_size=self.model.vocab_size, seed=seed, device=device)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Over every token of every sequence: (B, T, V) -> (B*T, V) against (B*T,).
        return F.cross_entropy(output.float().flatten(0, 1), targets.flatten())
