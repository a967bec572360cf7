"""The engine alone (``dspark.init()`` outside a launcher: no process group, nothing to reduce)
against plain single-process PyTorch: the path a one-GPU user runs. Its gradients are averaged
over the window's micro-batches and unscaled from fp16 in place (one multi-tensor kernel per
dtype), not by the reducer's buckets, so it needs a parity proof of its own; SGD without momentum
shows a wrong factor, fp16 is checked against autocast + GradScaler."""

from __future__ import annotations

import functools

import pytest

from tests.engine.harness import (
    mismatches,
    train_engine,
    train_reference,
    with_deferred_host_reads,
)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_process_with_accumulation_matches_pytorch(single_process, strategy: str,
                                                       optimizer: str) -> None:
    assert single_process.backend == "none"
    got = train_engine("tied", strategy, 3, optimizer=optimizer, accum=2)
    want = train_reference("tied", 3, optimizer=optimizer, accum=2)
    assert not mismatches(got["state"], want["state"], rtol=1e-5, atol=5e-5)


def test_a_wrong_factor_on_the_gradient_would_show(single_process) -> None:
    # the reference with every gradient halved differs: the SGD comparison above can fail
    got = train_engine("tied", "replicate", 3, optimizer="sgd", accum=2)
    halved = train_reference("tied", 3, optimizer="sgd_halved_gradient", accum=2)
    assert mismatches(got["state"], halved["state"], rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("order", ["host_decides", "device_skips"])
@pytest.mark.parametrize("strategy", ["replicate", "zero2"])
@pytest.mark.parametrize("model", ["tied", "mixed_dtypes"])
def test_one_process_fp16_matches_autocast_and_gradscaler(single_process, strategy: str,
                                                         model: str, order: str,
                                                         optimizer: str) -> None:
    # device_skips: a GPU's order of work (the norm read after the optimizer is queued), on CPU
    train = train_engine if order == "host_decides" else functools.partial(
        with_deferred_host_reads, train_engine)
    got = train(model, strategy, 3, optimizer=optimizer, precision="fp16", accum=2, clip=1e6)
    want = train_reference(model, 3, optimizer=optimizer, precision="fp16", accum=2, clip=1e6)
    assert not mismatches(got["state"], want["state"], rtol=3e-3, atol=1e-4)
    assert got["norms"] == pytest.approx(want["norms"], rel=3e-3)
