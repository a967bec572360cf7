"""[Note: the probe inside the budget]: auto predicts, before probing, how far its probe would take
the process at each micro-batch, and lets it train only the micro-batches that fit."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark.planner.probe_budget import PROBE_FIXED_BYTES, PROBE_TENSOR_FACTOR, ProbeNeed, probe_need

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
SGD = functools.partial(torch.optim.SGD, lr=1e-3)


def test_the_rise_grows_with_the_rows_and_the_largest_fitting_micro_batch_is_chosen() -> None:
    need = ProbeNeed(state_bytes=100 << 20, one_row_bytes=10 << 20, per_row_bytes=float(10 << 20))
    rises = {m: need.rise_bytes(m) for m in (1, 2, 4, 8)}
    assert rises[1] == int(PROBE_FIXED_BYTES + PROBE_TENSOR_FACTOR * (110 << 20))
    assert rises[8] - rises[4] == int(PROBE_TENSOR_FACTOR * (40 << 20))
    assert need.largest_within([8, 4, 2, 1], rises[4]) == 4
    assert need.largest_within([8, 4, 2, 1], rises[4] - 1) == 2
    assert need.largest_within([8, 4, 2, 1], rises[1] - 1) is None


def _wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 10))


@pytest.mark.parametrize("optimizer,copies", [(SGD, 2), (ADAMW, 4)], ids=["sgd", "adamw"])
def test_the_prediction_counts_the_probes_copy_of_the_state_and_its_activations_per_row(optimizer, copies) -> None:
    model = _wide()
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    need = probe_need(model, batch, loss_fn=F.cross_entropy, optimizer=optimizer, precision="fp32",
                      device=torch.device("cpu"), rows=16)
    assert need is not None
    params = sum(p.numel() * 4 for p in model.parameters())
    # parameters, gradients (and AdamW's two moments, and its step counter per tensor)
    assert copies * params <= need.state_bytes < copies * params + 1024
    # each row saves at least its 1024 hidden values (fp32) for backward
    assert need.per_row_bytes >= 1024 * 4
    assert need.rise_bytes(16) > need.rise_bytes(1)


def test_nothing_is_predicted_where_the_fake_trace_cannot_run_the_model() -> None:
    class Untraceable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * float(x.sum())  # reads a value: fake tensors have none

    batch = (torch.randn(4, 4), torch.randn(4, 4))
    assert probe_need(Untraceable(), batch, loss_fn=F.mse_loss, optimizer=SGD, precision="fp32",
                      device=torch.device("cpu"), rows=4) is None
