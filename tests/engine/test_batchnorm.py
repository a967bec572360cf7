"""BatchNorm (finding 2 of issue 7). In training mode BatchNorm normalises with each rank's own batch
statistics, so one process on the whole batch is not the reference: PyTorch's DDP is. DDP broadcasts
rank 0's buffers before every forward, so what a DDP user evaluates and checkpoints is rank 0's running
statistics; the engine must give those on every rank (``full_state_dict``, evaluation, checkpoints),
whichever rank is asked. ``sync_batchnorm=True`` normalises with the statistics of the global batch
instead (what ``torch.nn.SyncBatchNorm`` does, on CUDA only): one process on the whole batch is then
the reference, on any backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dspark
from tests.engine.harness import (
    assert_close,
    build_engine,
    evaluate_engine,
    train_ddp,
    train_engine,
    train_reference,
    train_steps,
)

STEPS = 3
SYNC_RTOL = 1e-4
"""Global statistics combine the ranks' sums in another order than one process does (~1e-6). The
smallest wrong factor it must catch is the unbiased variance's n/(n-1) taken with a rank's count
instead of the global one: 36/35 vs 72/71 for the second BatchNorm, 1e-3 on its running_var."""


def _buffers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("case", ["conv_bn", "conv_bn_channels_last"])
def test_running_statistics_equal_ddp_on_every_rank(pool, strategy: str, case: str) -> None:
    ddp = pool.run(train_ddp, case, STEPS, optimizer="sgd")[0]  # rank 0: what DDP checkpoints
    got = pool.run(train_engine, case, strategy, STEPS, optimizer="sgd", evaluate=True)
    for rank, result in enumerate(got):
        assert_close(_buffers(result["state"]), _buffers(ddp["state"]),
                     f"rank {rank}: {case} under {strategy}: BatchNorm running statistics against DDP's "
                     "(rank 0's, broadcast_buffers=True)")
        assert_close(result["state"], ddp["state"], f"rank {rank}: {case} under {strategy}: parameters and "
                     "buffers against DDP")
        assert_close({"eval": result["eval"]}, {"eval": ddp["eval"]},
                     f"rank {rank}: {case} under {strategy}: eval output against DDP's rank 0 (evaluation "
                     "must not depend on the rank)")


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_each_ranks_own_running_statistics_follow_rank_0_as_ddps(pool, strategy: str) -> None:
    """What each rank holds between steps, with no collective to hide it: DDP's rank r has rank 0's
    buffers of the last forward, updated once by its own batch. BatchNorm's CPU kernel updates its
    running statistics in place without bumping their version counter, so a sync that watched the
    counters alone followed only num_batches_tracked and let rank 1 drift on its own batches."""
    ddp = pool.run(train_ddp, "conv_bn", STEPS + 1, optimizer="sgd")
    got = pool.run(train_engine, "conv_bn", strategy, STEPS + 1, optimizer="sgd")
    key = next(k for k in ddp[0]["local_buffers"] if k.endswith("running_mean"))
    assert not torch.equal(ddp[0]["local_buffers"][key], ddp[1]["local_buffers"][key]), \
        "the ranks' batches must differ, or this test could not fail"
    for rank in range(2):
        assert_close(_buffers(got[rank]["local_buffers"]), _buffers(ddp[rank]["local_buffers"]),
                     f"rank {rank}: its own BatchNorm buffers under {strategy} against DDP's rank {rank} "
                     "(rank 0's broadcast before each forward, then this rank's update)")


def _save(path: str, strategy: str) -> dict[str, torch.Tensor]:
    engine = build_engine("conv_bn", strategy, optimizer="sgd")
    train_steps(engine, "conv_bn", range(2))
    engine.save(path)
    state = engine.full_state_dict()
    engine.close()
    return state


def _load(path: str, strategy: str) -> dict[str, Any]:
    """A fresh engine whose BatchNorm buffers differ from the saved ones (and between ranks) loads."""
    engine = build_engine("conv_bn", strategy, optimizer="sgd")
    rank = dspark.get_world().rank
    for module in engine.module.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.fill_(10.0 + rank)
            module.running_var.fill_(20.0 + rank)
    engine.load(path)
    out = {"state": engine.full_state_dict(), "eval": evaluate_engine(engine, "conv_bn")}
    engine.close()
    return out


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_checkpoint_round_trip_keeps_rank_0s_running_statistics(pool, single_process, tmp_path: Path,
                                                                strategy: str) -> None:
    """Save on 2 ranks; load on 2 and on 1: every rank holds the statistics that were saved (rank 0's,
    as DDP checkpoints), never a mix of the ranks' statistics picked by DCP's planner."""
    path = str(tmp_path / "ckpt")
    saved = pool.run(_save, path, strategy)
    want = _buffers(saved[0])
    loaded = [*pool.run(_load, path, strategy), _load(path, strategy)]
    for where, result in zip(("rank 0 of 2", "rank 1 of 2", "1 process"), loaded, strict=True):
        assert_close(_buffers(result["state"]), want, f"{strategy}: BatchNorm buffers loaded on {where} "
                     "against those rank 0 held at the save", rtol=0.0, atol=0.0)
        assert_close({"eval": result["eval"]}, {"eval": loaded[0]["eval"]},
                     f"{strategy}: eval output after the load on {where} against rank 0 of 2's")


def test_sync_batchnorm_matches_one_process_on_the_whole_batch(pool, strategy: str) -> None:
    want = train_reference("conv_bn", STEPS, optimizer="sgd")
    got = pool.run(train_engine, "conv_bn", strategy, STEPS, optimizer="sgd", evaluate=True, sync_batchnorm=True)
    for rank, result in enumerate(got):
        assert_close(result["state"], want["state"], f"rank {rank}: {strategy} with sync_batchnorm=True "
                     "(parameters and running statistics) against one process", rtol=SYNC_RTOL)
        assert_close({"eval": result["eval"]}, {"eval": want["eval"]},
                     f"rank {rank}: eval output with sync_batchnorm=True against one process", rtol=SYNC_RTOL)


def test_without_sync_the_statistics_really_differ_from_one_process(pool) -> None:
    """The sync test's power: per-rank statistics (DDP's) are far from one process's (running means
    by 10 % to 20 %; running variances by < 1 %, the unbiased correction's count is what differs)."""
    want = train_reference("conv_bn", STEPS, optimizer="sgd")["state"]
    ddp = pool.run(train_ddp, "conv_bn", STEPS, optimizer="sgd")[0]["state"]
    with pytest.raises(AssertionError, match="running_mean"):
        assert_close(_buffers(ddp), _buffers(want), "DDP vs one process", rtol=100 * SYNC_RTOL)
