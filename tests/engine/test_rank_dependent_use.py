"""A parameter only some ranks use in a step (a data-dependent branch) trains as in one process.

The gradient buffers are allocated anew in every window (see [Note: gradients live in buckets]), so
a rank that never touches a parameter must send zeros for it, not whatever the fresh memory holds.
Compared with plain single-process PyTorch on the whole batch, with SGD (a stale or doubled
contribution moves the branch visibly) and AdamW, over several steps so the rebuilt buckets are
used too."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import dspark
from tests.engine.harness import SGD_LR, assert_close

STEPS = 4
GLOBAL_BATCH = 8
FACTORIES = {"sgd": functools.partial(torch.optim.SGD, lr=SGD_LR),
             "adamw": functools.partial(torch.optim.AdamW, lr=1e-2)}


class Branchy(nn.Module):
    """``branch`` runs only on the rows flagged in the batch; every flagged row is in rank 0's half."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 3)
        self.branch = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)
        rows = flag.nonzero().squeeze(1)
        if rows.numel():
            out = out.index_add(0, rows, self.branch(x[rows]))
        return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g)
    y = torch.randn(GLOBAL_BATCH, 3, generator=g)
    flag = torch.zeros(GLOBAL_BATCH, dtype=torch.bool)
    flag[: 1 + step % 3] = True  # rows 0..2: rank 0's half of the batch on 2 ranks
    return x, flag, y


def _model() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def _reference(optimizer: str) -> dict[str, torch.Tensor]:
    model = _model()
    opt = FACTORIES[optimizer](model.parameters())
    for step in range(STEPS):
        x, flag, y = _batch(step)
        nn.functional.mse_loss(model(x, flag), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(strategy: str, optimizer: str) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(_model(), optimizer=FACTORIES[optimizer], strategy=strategy)
    for step in range(STEPS):
        x, flag, y = dspark.distribute_batch(_batch(step), shard_dim=0)
        engine.backward(nn.functional.mse_loss(engine(x, flag), y))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_branch_only_rank_0_runs_trains_as_in_one_process(pool, strategy: str, optimizer: str) -> None:
    want = _reference(optimizer)
    assert not torch.equal(want["branch.weight"], _model().branch.weight.detach())  # it did train
    for rank, got in enumerate(pool.run(_train, strategy, optimizer)):
        assert_close(got, want, f"rank {rank}, {strategy}, {optimizer}")
