"""Parity that a wrong factor cannot pass. AdamW is invariant to a constant factor on the gradient, so a
wrong 1/N, 1/grad_accum_steps or 1/loss scale passes every AdamW parity test; plain SGD without
momentum moves each parameter by lr * gradient, so it cannot. Every strategy, with accumulation and
with clipping, with one parameter per bucket and with realistic 25 MB buckets (the whole model shares
one bucket); ``engine.last_grad_norm`` against what ``torch.nn.utils.clip_grad_norm_`` returns in one
process on the same global batch."""

from __future__ import annotations

import pytest

from tests.engine.harness import assert_close, mismatches, train_engine, train_reference

STEPS = 3
CLIP = 1.0
"""Below every step's gradient norm (1.4 to 2.8 for the tied model): clipping acts on every step, so
the parameters no longer show a wrong factor and the norm has to."""
MODES = {"plain": {}, "accum2": {"accum": 2}, "clip": {"clip": CLIP}}
BUCKETS = {"bucket_per_param": 1e-4, "bucket_25mb": 25.0}


def test_sgd_parity_would_catch_a_wrong_factor() -> None:
    """The tests' own power: the same training with every gradient halved ends far outside the
    tolerance, on every tensor that trains (from 2 % for the embedding to 38 % for the norm's bias:
    a thousand times the 1e-5 the parity tests allow)."""
    want = train_reference("tied", STEPS, optimizer="sgd")["state"]
    halved = train_reference("tied", STEPS, optimizer="sgd_halved_gradient")["state"]
    trained = {k: v for k, v in want.items() if not k.startswith("unused.")}  # never gets a gradient
    caught = mismatches({k: halved[k] for k in trained}, trained, rtol=1e-2, atol=0.0)
    assert len(caught) == len(trained), caught


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("mode", MODES)
def test_sgd_parity_with_one_process(pool, strategy: str, mode: str, bucket: str) -> None:
    kwargs = MODES[mode]
    want = train_reference("tied", STEPS, optimizer="sgd", **kwargs)
    got = pool.run(train_engine, "tied", strategy, STEPS, optimizer="sgd", bucket_mb=BUCKETS[bucket], **kwargs)
    for rank, result in enumerate(got):
        assert_close(result["state"], want["state"], f"rank {rank}: {strategy} + SGD ({mode}, {bucket}) "
                     "against one process on the whole batch")
        if mode == "clip":
            assert min(want["norms"]) > CLIP, want["norms"]  # clipping really acted
            assert result["norms"] == pytest.approx(want["norms"], rel=1e-5), (
                f"rank {rank}: engine.last_grad_norm per step {result['norms']} != "
                f"clip_grad_norm_ in one process {want['norms']} ({strategy}, {bucket})")


def test_sgd_parity_with_uneven_rows_and_a_0d_parameter(pool, strategy: str) -> None:
    # mlp: 7-row layers split 4 + 3, and a 0-d parameter that rank 1 holds none of
    want = train_reference("mlp", STEPS, optimizer="sgd", clip=CLIP)
    for rank, result in enumerate(pool.run(train_engine, "mlp", strategy, STEPS, optimizer="sgd", clip=CLIP,
                                           bucket_mb=25.0)):
        assert_close(result["state"], want["state"], f"rank {rank}: {strategy} + SGD on the mlp")
        assert result["norms"] == pytest.approx(want["norms"], rel=1e-5), (rank, result["norms"], want["norms"])


def test_adamw_parity_with_realistic_buckets(pool, strategy: str) -> None:
    # (accumulation and clipping under AdamW: tests/engine/test_parity.py, one parameter per bucket)
    want = train_reference("tied", STEPS, optimizer="adamw")
    for rank, result in enumerate(pool.run(train_engine, "tied", strategy, STEPS, optimizer="adamw", bucket_mb=25.0)):
        assert_close(result["state"], want["state"], f"rank {rank}: {strategy} + AdamW (25 MB buckets)")
