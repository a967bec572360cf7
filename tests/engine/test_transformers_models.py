"""Models nobody here wrote: HuggingFace ``transformers`` models from small configs (no downloads,
dropout off), trained on 2 ranks under every strategy. GPT-2 (tied head), BERT (masked LM, tied
decoder) and BERT fine-tuned as a binary classifier (its head's bias one element per rank) must end
with the parameters of single-process training, with SGD and with AdamW, and the trained engine's
module must evaluate (eval mode, no_grad) like the reference. ResNet has BatchNorm, so in training
mode each rank normalises with its own batch: PyTorch's DDP on the same slices is the reference
there (parameters and running statistics); with ``sync_batchnorm=True``, one process again."""

from __future__ import annotations

import pytest

from tests.engine.harness import (
    ATOL,
    ATOL_ADAMW,
    assert_close,
    train_ddp,
    train_engine,
    train_reference,
)

STEPS = 2


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("model", ["gpt2", "bert", "bert_classifier"])
def test_language_model_trains_like_one_process(pool, model: str, strategy: str, optimizer: str) -> None:
    # AdamW turns rounding-noise gradients (the attention key bias) into full-size updates: ATOL_ADAMW
    atol = ATOL if optimizer == "sgd" else ATOL_ADAMW
    want = train_reference(model, STEPS, optimizer=optimizer)
    got = pool.run(train_engine, model, strategy, STEPS, optimizer=optimizer, evaluate=True, bucket_mb=25.0)
    for rank, result in enumerate(got):
        assert_close(result["state"], want["state"], f"rank {rank}: HuggingFace {model} under {strategy} + "
                     f"{optimizer} against one process", atol=atol)
        assert_close({"logits": result["eval"]}, {"logits": want["eval"]},
                     f"rank {rank}: the trained {model}'s eval logits under {strategy} + {optimizer}", atol=atol)


def test_resnet_with_batchnorm_equals_ddp(pool, strategy: str) -> None:
    ddp = pool.run(train_ddp, "resnet", STEPS, optimizer="sgd")[0]  # rank 0: what DDP checkpoints
    got = pool.run(train_engine, "resnet", strategy, STEPS, optimizer="sgd", evaluate=True, bucket_mb=25.0)
    for rank, result in enumerate(got):
        assert_close(result["state"], ddp["state"], f"rank {rank}: HuggingFace ResNet under {strategy} "
                     "(parameters and BatchNorm running statistics) against DDP")
        assert_close({"logits": result["eval"]}, {"logits": ddp["eval"]},
                     f"rank {rank}: the trained ResNet's eval logits under {strategy} against DDP's rank 0")


def test_resnet_with_sync_batchnorm_equals_one_process(pool, strategy: str) -> None:
    want = train_reference("resnet", STEPS, optimizer="sgd")
    got = pool.run(train_engine, "resnet", strategy, STEPS, optimizer="sgd", evaluate=True, bucket_mb=25.0,
                   sync_batchnorm=True)
    for rank, result in enumerate(got):
        assert_close(result["state"], want["state"], f"rank {rank}: ResNet with sync_batchnorm=True under "
                     f"{strategy} against one process", rtol=1e-4)
        assert_close({"logits": result["eval"]}, {"logits": want["eval"]},
                     f"rank {rank}: ResNet eval logits with sync_batchnorm=True under {strategy}", rtol=1e-4)
