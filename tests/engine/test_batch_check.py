"""The engine's replicated-batch check on 2 real ranks: it raises on every rank when the ranks feed the
model the same batch (the usual ways that happens), and stays silent on correctly split data."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import dspark
from dspark import comm
from dspark.tensor.fingerprint import FINGERPRINT_LEN
from tests.messages import assert_line_names

GLOBAL_BATCH = 8


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _engine(**kwargs: Any) -> dspark.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.05), **kwargs)


def _batches(source: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four of this rank's batches, loaded the way ``source`` says."""
    if source == "plain DataLoader":  # no sampler: every rank reads the same batches
        return list(TorchDataLoader(_dataset(), batch_size=GLOBAL_BATCH // 2, shuffle=False))[:4]
    if source == "dspark.DataLoader":
        return list(dspark.DataLoader(_dataset(), global_batch_size=GLOBAL_BATCH, seed=1))[:4]
    whole = list(TorchDataLoader(_dataset(), batch_size=GLOBAL_BATCH, shuffle=False))[:4]
    shard_dim = dspark.REPLICATE if source == "REPLICATE" else 0
    return [dspark.distribute_batch(batch, shard_dim=shard_dim) for batch in whole]


def _train(source: str, **engine_kwargs: Any) -> dict[str, Any]:
    engine = _engine(**engine_kwargs)
    batches = _batches(source)  # before counting: dspark.DataLoader's pass starts with its own gather
    comm.reset_stats()
    steps, error = 0, None
    try:
        for x, y in batches:
            with torch.no_grad():  # an evaluation on the same data everywhere is not a mistake
                engine(torch.ones(2, 6))
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            steps += 1
    except dspark.PlacementError as exc:
        error = str(exc)
    gathers = comm.stats().get("all_gather", comm.CollectiveStats())
    out = {"steps": steps, "error": error, "checks": engine.batch_check.checks,
           "gather_calls": gathers.calls, "gather_bytes": gathers.bytes,
           "last_inputs": [(leaf.shape, leaf.nbytes) for leaf in engine.batch_check.last_inputs]}
    engine.close()
    return out


@pytest.mark.parametrize("source", ["plain DataLoader", "REPLICATE"])
def test_identical_batches_raise_on_every_rank_at_the_first_step(pool, source: str) -> None:
    results = pool.run(_train, source)
    for rank, result in enumerate(results):
        assert result["steps"] == 0, result
        message = result["error"]
        assert message is not None and message.startswith(f"rank {rank}: "), message
        assert_line_names(message, "ranks 0 and 1", "identical input", "step 0")
        rows = GLOBAL_BATCH // 2 if source == "plain DataLoader" else GLOBAL_BATCH
        assert f"({rows}, 6) float32" in message
        for fix in ("dspark.DataLoader", "DistributedSampler", "same random seed",
                    "shard_dim=dspark.REPLICATE", "batch_check_every=None"):
            assert fix in message, (fix, message)


@pytest.mark.parametrize("source", ["dspark.DataLoader", "split"])
def test_correctly_split_data_passes_and_costs_one_tiny_gather(pool, source: str) -> None:
    for result in pool.run(_train, source, batch_check_every=2):
        assert result["error"] is None and result["steps"] == 4
        assert result["checks"] == 2  # steps 0 and 2
        assert result["gather_calls"] == 2 and result["gather_bytes"] == 2 * FINGERPRINT_LEN * 8
        assert result["last_inputs"] == [((GLOBAL_BATCH // 2, 6), GLOBAL_BATCH // 2 * 6 * 4)]


def test_turned_off_it_sends_nothing_and_raises_nothing(pool) -> None:
    for result in pool.run(_train, "REPLICATE", batch_check_every=None):
        assert result["error"] is None and result["steps"] == 4
        assert result["checks"] == 0 and result["gather_calls"] == 0


def _replicated_from_step(first_bad_step: int, every: int) -> dict[str, Any]:
    """Split batches, then (from ``first_bad_step`` on) the same batch on every rank."""
    engine = _engine(batch_check_every=every)
    whole = list(TorchDataLoader(_dataset(), batch_size=GLOBAL_BATCH, shuffle=False))
    raised_at = None
    for step, batch in enumerate(whole[:5]):
        x, y = dspark.distribute_batch(batch, shard_dim=dspark.REPLICATE if step >= first_bad_step else 0)
        try:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        except dspark.PlacementError:
            raised_at = step
            break
        engine.step()
    engine.close()
    return {"raised_at": raised_at}


def test_later_steps_are_checked_every_k_steps(pool) -> None:
    assert pool.run(_replicated_from_step, 1, 3) == [{"raised_at": 3}] * 2
    assert pool.run(_replicated_from_step, 1, 1) == [{"raised_at": 1}] * 2


def test_a_bad_setting_is_refused(single_process) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="batch_check_every="):
            _engine(batch_check_every=bad)
    assert not _engine(batch_check_every=0).batch_check.enabled
    assert not _engine().batch_check.enabled  # one rank: nothing to compare


def test_the_cost_of_some_ranks_alike_is_not_called_all_alike() -> None:
    from dspark.engine.batch_check import replication_cost

    assert_line_names(replication_cost([(0, 1)], 2), "2 ranks", "work of one")
    assert_line_names(replication_cost([(0, 1), (0, 2), (1, 2)], 3), "3 ranks", "work of one")
    assert_line_names(replication_cost([(0, 2)], 3), "same samples", "3 ranks", "work of 2")
    assert_line_names(replication_cost([(0, 1), (2, 3)], 4), "4 ranks", "work of 2")


class _Holder:
    """A batch in a container the check cannot look into (not a tuple, list, dict or dataclass)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class _HolderModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 1)

    def forward(self, batch: _Holder) -> torch.Tensor:
        return self.lin(batch.x)


def _blind_batch() -> list[str]:
    import warnings

    torch.manual_seed(0)
    engine = dspark.Engine(_HolderModel(), optimizer=functools.partial(torch.optim.SGD, lr=0.05))
    x = torch.ones(4, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            engine.backward(engine(_Holder(x)).sum())
            engine.step()
    return [str(w.message) for w in caught if "replicated-batch check" in str(w.message)]


def test_inputs_it_cannot_see_into_are_warned_about_once(pool) -> None:
    for messages in pool.run(_blind_batch):
        assert len(messages) == 1, messages
        assert "_Holder" in messages[0] and "batch_check_every=None" in messages[0]
