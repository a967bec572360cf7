"""The benchmark workloads by name: the seed's real sizes and CPU-sized presets of the same code.

==============  =============================================  ===========  =====  =========
name            model and data                                 parameters   batch  precision
==============  =============================================  ===========  =====  =========
resnet50        ResNet-50; 3x224x224 images, 1000 classes       25,557,032    256  fp16
gpt2-124m       GPT-2 124M; 1024 tokens, vocabulary 50257      124,439,808    256  fp16
resnet50-cpu    ResNet-50 layout at width 16; 3x96x96, 100       1,532,276    128  bf16
gpt2-cpu        GPT-2 layout, 4 layers x 256; 128 tokens, 2048   3,716,608     32  bf16
==============  =============================================  ===========  =====  =========

The real sizes carry the seed article's config (global batch 256, fp16 mixed precision). GPT-2
124M runs a rank's share of it in micro-batches of at most 32 sequences (``max_micro_batch``):
one pass over 32 x 1024 tokens holds tens of GiB in fp16 on one H200 (its peak per rank:
docs/figures.md#2026-12-04-h200), so 256 at once would not fit; the optimizer still steps once per
global batch of 256. The presets are sized so that one training step (forward, backward, AdamW)
takes under a second on one CPU core while the model stays small next to that compute: the
gradient all-reduce over loopback gloo is a small part of a step, so 2 cores can approach the ideal
speedup of two (the quick suite's figures: docs/figures.md#quick-suite).

[Note: CPU precision] Both presets default to bf16 autocast, for CPUs that multiply bf16 natively
(AMX, AVX512-BF16 dot products), where it is the faster precision; fp16 never is on a CPU: it has
no fast kernels there. ``OMP_NUM_THREADS=1 .venv/bin/python -m dspark.models.step_time
resnet50-cpu gpt2-cpu --steps 6`` times one step of each in fp32 and bf16 on this machine, and the
lab's CPU suites time a matrix product in both before they run and fall back to fp32 where bf16 is
the slower (:mod:`dspark.bench.measure.cpu_precision`). Step times move a great deal when other processes
share the cores: measure on an idle machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from dspark.models.gpt import GPTConfig
from dspark.models.resnet import ResNetConfig
from dspark.models.workload import ImageClassification, LanguageModeling, Workload

__all__ = ["WORKLOADS", "get_workload"]

_ALL: tuple[Workload, ...] = (
    ImageClassification(
        name="resnet50",
        description="ResNet-50 on ImageNet-shaped images (3x224x224, 1000 classes)",
        default_global_batch=256, default_precision="fp16",
        model=ResNetConfig(), image_size=224),
    LanguageModeling(
        name="gpt2-124m",
        description="GPT-2 124M on token sequences (1024 tokens, vocabulary 50257)",
        default_global_batch=256, default_precision="fp16", max_micro_batch=32,
        model=GPTConfig(), seq_len=1024),
    ImageClassification(
        name="resnet50-cpu",
        description="ResNet-50 layout at width 16 on 3x96x96 images, 100 classes (CPU-sized)",
        default_global_batch=128, default_precision="bf16",
        model=ResNetConfig(base_width=16, num_classes=100), image_size=96),
    LanguageModeling(
        name="gpt2-cpu",
        description="GPT-2 layout, 4 layers x 256 wide, 128 tokens, vocabulary 2048 (CPU-sized)",
        default_global_batch=32, default_precision="bf16",
        model=GPTConfig(vocab_size=2048, context_len=128, num_layers=4, num_heads=4, width=256),
        seq_len=128),
)

WORKLOADS: Mapping[str, Workload] = MappingProxyType({wl.name: wl for wl in _ALL})
"""Every workload by name (read-only)."""


def get_workload(name: str) -> Workload:
    """The workload registered as ``name``; an unknown name raises ``ValueError`` listing the valid ones.

    Example::

        wl = get_workload("gpt2-cpu")
        tokens, targets = wl.make_batch(wl.default_global_batch, seed=0)
    """
    try:
        return WORKLOADS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown workload {name!r}; valid names: {', '.join(WORKLOADS)}") from None
