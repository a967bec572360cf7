"""bf16 and fp16 against single-process PyTorch as users write it: ``torch.autocast`` around the forward
on the whole batch, and for fp16 ``torch.amp.GradScaler`` (same initial scale as the engine's). The
engine's own 1-rank run is not a reference: it would share any mistake.

[Note: mixed-precision tolerance] Low precision makes the result depend on how the batch is split, so
the tolerance is the spread of the reference itself: the same PyTorch training on the whole batch vs on
2 or 4 equal pieces whose gradients add up (what 2 ranks do), measured on the tied model over 3 steps,
as the worst ||a - b|| / ||b|| over its tensors:

    SGD   bf16 2.9e-3   fp16 8.2e-4        AdamW   bf16 1.7e-4   fp16 3.3e-5

The tolerances below are about 5 times that. A wrong factor is far outside them: halving the SGD
gradient moves the tensors by 2 % to 38 %, a missing 1/loss-scale by a factor 65536.
"""

from __future__ import annotations

import pytest

from tests.engine.harness import (
    ATOL,
    assert_close,
    train_engine,
    train_reference,
    with_deferred_host_reads,
)

STEPS = 3
TOLERANCE = {("bf16", "sgd"): 1.5e-2, ("fp16", "sgd"): 4e-3, ("bf16", "adamw"): 1e-3, ("fp16", "adamw"): 2e-4}
NEVER_CLIPS = 1e6
"""Above every gradient norm: the engine measures ``last_grad_norm`` while SGD stays scale-sensitive."""
MODES = {"sgd": ("sgd", NEVER_CLIPS), "adamw": ("adamw", None)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_matches_autocast_pytorch(pool, strategy: str, precision: str, mode: str) -> None:
    optimizer, clip = MODES[mode]
    rtol = TOLERANCE[(precision, optimizer)]
    want = train_reference("tied", STEPS, optimizer=optimizer, clip=clip, precision=precision)
    got = pool.run(train_engine, "tied", strategy, STEPS, optimizer=optimizer, clip=clip, precision=precision,
                   bucket_mb=25.0)
    for rank, result in enumerate(got):
        assert_close(result["state"], want["state"], f"rank {rank}: {strategy} {precision} + {mode} against "
                     "torch.autocast" + (" + GradScaler" if precision == "fp16" else "") + " in one process",
                     rtol=rtol, atol=ATOL)
        if clip is not None:
            assert result["norms"] == pytest.approx(want["norms"], rel=rtol), (
                f"rank {rank}: engine.last_grad_norm {result['norms']} != clip_grad_norm_ of the unscaled "
                f"gradients in one process {want['norms']} ({strategy}, {precision})")


@pytest.mark.parametrize("clip", [NEVER_CLIPS, 0.05])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_gpus_order_of_work_matches_autocast_pytorch(pool, strategy: str, precision: str,
                                                        clip: float) -> None:
    """A GPU's step (clip coefficient on the device, fp16's overflow check handed to the fused
    kernel, the norm read last) on these CPU ranks, against one process; SGD, so that a wrong factor
    shows, clipping (0.05 is below every norm here) or only measuring."""
    rtol = TOLERANCE[(precision, "sgd")]
    want = train_reference("tied", STEPS, optimizer="sgd", clip=clip, precision=precision)
    got = pool.run(with_deferred_host_reads, train_engine, "tied", strategy, STEPS, optimizer="sgd",
                   clip=clip, precision=precision, bucket_mb=25.0)
    for rank, result in enumerate(got):
        assert_close(result["state"], want["state"], f"rank {rank}: {strategy} {precision}, clip "
                     f"{clip:g}, the GPU's order of work, against torch.autocast in one process",
                     rtol=rtol, atol=ATOL)
        assert result["norms"] == pytest.approx(want["norms"], rel=rtol)
