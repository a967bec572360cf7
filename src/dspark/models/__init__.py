"""Benchmark workloads: ResNet-50 and GPT-2 124M at their real sizes, and CPU-sized presets.

Models are leaves of the package graph: nothing here imports the engine, the bench or the CLI.

Example::

    from dspark.models import get_workload
    wl = get_workload("resnet50-cpu")              # unknown name -> ValueError listing the names
    model = wl.build_model(seed=0)
    inputs, targets = wl.make_batch(wl.default_global_batch, seed=0)
    loss = wl.loss(model(inputs), targets)
"""

from dspark.models.data import synthetic_images, synthetic_tokens
from dspark.models.gpt import GPT, GPTConfig
from dspark.models.registry import WORKLOADS, get_workload
from dspark.models.resnet import ResNet, ResNetConfig
from dspark.models.workload import (
    PRECISIONS,
    ImageClassification,
    LanguageModeling,
    Workload,
    count_params,
)

__all__ = [
    "GPT",
    "PRECISIONS",
    "WORKLOADS",
    "GPTConfig",
    "ImageClassification",
    "LanguageModeling",
    "ResNet",
    "ResNetConfig",
    "Workload",
    "count_params",
    "get_workload",
    "synthetic_images",
    "synthetic_tokens",
]
