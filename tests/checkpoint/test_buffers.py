"""Buffers (BatchNorm's running statistics) are saved once, from rank 0, after every rank was given
rank 0's values; a load at any world size gives every rank the same buffers."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

import dspark
from tests.engine.harness import LR

GLOBAL_BATCH = 8


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.lin(x))))


def _engine(seed: int) -> dspark.Engine:
    torch.manual_seed(seed)
    return dspark.Engine(_NormNet(), optimizer=functools.partial(torch.optim.SGD, lr=LR, momentum=0.9),
                         strategy="zero2")


def _buffers(engine: dspark.Engine) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in engine.module.named_buffers()}


def _train_and_save(path: str, steps: int) -> dict[str, dict[str, torch.Tensor]]:
    engine = _engine(seed=0)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(GLOBAL_BATCH, 4, generator=g) * (1 + torch.arange(GLOBAL_BATCH)[:, None])
        xl, yl = dspark.distribute_batch((x, torch.randn(GLOBAL_BATCH, 2, generator=g)), shard_dim=0)
        engine.backward(nn.functional.mse_loss(engine(xl), yl))
        engine.step()
    before = _buffers(engine)
    engine.save(path)
    out = {"before": before, "after": _buffers(engine)}
    engine.close()
    return out


def _load(path: str) -> dict[str, torch.Tensor]:
    engine = _engine(seed=1)
    engine.load(path)
    out = _buffers(engine)
    engine.close()
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_two_ranks_save_rank_0s_buffers_and_one_rank_loads_them(pool, single_process, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    ranks = pool.run(_train_and_save, path, 2)
    rank0, rank1 = ranks[0]["before"], ranks[1]["before"]
    assert not torch.equal(rank0["norm.running_mean"], rank1["norm.running_mean"])  # each saw its rows
    for rank in ranks:  # the save gave every rank rank 0's values
        _assert_equal(rank["after"], rank0)
    loaded = _load(path)
    _assert_equal(loaded, rank0)
    assert int(loaded["norm.num_batches_tracked"]) == 2


def test_one_rank_saves_and_two_ranks_load_the_same_buffers(pool, single_process, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = _train_and_save(path, 3)["before"]
    for loaded in pool.run(_load, path):
        _assert_equal(loaded, saved)
