"""Finding 1 of issue 7: a convolutional model in ``torch.channels_last`` (the layout recommended for
convolutions on GPUs and CPUs with AMX). Its weight gradients have the parameter's NHWC strides, so
copying a reduced gradient back with ``.view(-1)`` fails; the engine must train it like one process."""

from __future__ import annotations

import torch

from tests.engine.cases import get_case
from tests.engine.harness import assert_close, train_engine, train_reference


def test_the_case_really_is_channels_last() -> None:
    model = get_case("conv_channels_last").build()
    conv = model.features[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()


def test_channels_last_convnet_trains_like_one_process(pool, strategy: str) -> None:
    want = train_reference("conv_channels_last", 3, optimizer="sgd")
    got = pool.run(train_engine, "conv_channels_last", strategy, 3, optimizer="sgd", bucket_mb=25.0, evaluate=True)
    for rank, result in enumerate(got):
        assert_close(result["state"], want["state"], f"rank {rank}: channels_last convnet under {strategy}")
        assert_close({"logits": result["eval"]}, {"logits": want["eval"]},
                     f"rank {rank}: eval output of the trained channels_last convnet ({strategy})")
