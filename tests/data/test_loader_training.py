"""Training with dspark.DataLoader on 2 real ranks ends where plain single-process PyTorch does when
it trains on the same global batches (those of the loader at world size 1, whose order the pure
tests pin down)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import TensorDataset

import dspark
from dspark.engine.grad_reducer import UnequalBatchesError
from tests.messages import assert_names

GLOBAL_BATCH = 8
EPOCHS = 2


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(36, 5, generator=g)
    return TensorDataset(x, torch.sin(x).sum(dim=1, keepdim=True))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _optimizer(name: str) -> functools.partial[torch.optim.Optimizer]:
    if name == "sgd":  # not scale-invariant: a wrong factor on the gradient shows
        return functools.partial(torch.optim.SGD, lr=0.1)
    return functools.partial(torch.optim.AdamW, lr=1e-2)


def _train_on_ranks(optimizer: str, strategy: str) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(_model(), optimizer=_optimizer(optimizer), strategy=strategy)
    loader = dspark.DataLoader(_dataset(), global_batch_size=GLOBAL_BATCH, seed=4)
    for _ in range(EPOCHS):
        for x, y in loader:
            assert len(x) == GLOBAL_BATCH // 2
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def _train_in_one_process(optimizer: str) -> dict[str, torch.Tensor]:
    model = _model()
    opt = _optimizer(optimizer)(model.parameters())
    global_batches = dspark.DataLoader(_dataset(), global_batch_size=GLOBAL_BATCH, seed=4, rank=0,
                                       world_size=1)
    for _ in range(EPOCHS):
        for x, y in global_batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return model.state_dict()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", ["replicate", "zero2"])
def test_two_ranks_train_like_one_process(pool, optimizer: str, strategy: str) -> None:
    reference = _train_in_one_process(optimizer)
    for state in pool.run(_train_on_ranks, optimizer, strategy):
        for name, want in reference.items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)


def _train_uneven_on_ranks(optimizer: str, strategy: str, num_samples: int) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(_model(), optimizer=_optimizer(optimizer), strategy=strategy)
    loader = dspark.DataLoader(_dataset_of(num_samples), global_batch_size=GLOBAL_BATCH, seed=4,
                               drop_last=False)
    for _ in range(EPOCHS):
        for x, y in loader:
            assert loader.batch_info is not None
            engine.backward(torch.nn.functional.mse_loss(engine(x), y),
                            weight=loader.batch_info.local_size)
            engine.step()
    state = engine.full_state_dict()
    engine.close()
    return state


def _dataset_of(num_samples: int) -> TensorDataset:
    whole = _dataset()
    return TensorDataset(*(t[:num_samples] for t in whole.tensors))


def _train_uneven_in_one_process(optimizer: str, num_samples: int) -> dict[str, torch.Tensor]:
    model = _model()
    opt = _optimizer(optimizer)(model.parameters())
    global_batches = dspark.DataLoader(_dataset_of(num_samples), global_batch_size=GLOBAL_BATCH, seed=4,
                                       drop_last=False, rank=0, world_size=1)
    for _ in range(EPOCHS):
        for x, y in global_batches:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return model.state_dict()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize(("strategy", "num_samples"), [("replicate", 35), ("zero3", 33)])
def test_drop_last_false_trains_like_one_process_on_every_sample(pool, optimizer: str, strategy: str,
                                                                  num_samples: int) -> None:
    """The last global batch holds 3 samples (2 + 1 rows) or 1 (rank 1 gets a padding batch, see
    [Note: padding batches]): weighted by batch_info.local_size, the step is one process's on the
    same global batch."""
    reference = _train_uneven_in_one_process(optimizer, num_samples)
    for state in pool.run(_train_uneven_on_ranks, optimizer, strategy, num_samples):
        for name, want in reference.items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)


def _train_unweighted_over_padding() -> str:
    engine = dspark.Engine(_model(), optimizer=_optimizer("sgd"), strategy="zero2")
    loader = dspark.DataLoader(_dataset_of(33), global_batch_size=GLOBAL_BATCH, seed=4, drop_last=False)
    try:
        for x, y in loader:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
    except UnequalBatchesError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


def test_an_unweighted_step_over_a_padding_batch_is_refused(pool) -> None:
    """Both ranks' last batch has one row, but rank 1's is padding (a copy of rank 0's sample): the
    engine counts it as none, so the unweighted step is refused rather than training on the sample
    twice."""
    for message in pool.run(_train_unweighted_over_padding):
        assert_names(message, "rank 0: 1", "rank 1: 0", "weight=loader.batch_info.local_size")


def _window_of_two(num_samples: int, *, ranks: bool, strategy: str = "replicate") -> dict[str, torch.Tensor]:
    """Two batches a step, each weighted by the rows the loop sees (``len(x)``, as a token count read
    from the batch would be): on the ranks the last window is a real batch and, on rank 1, a padding
    batch of one row."""
    model = _model()
    loader = dspark.DataLoader(_dataset_of(num_samples), global_batch_size=GLOBAL_BATCH, seed=4,
                               drop_last=False, **({} if ranks else {"rank": 0, "world_size": 1}))
    if ranks:
        engine = dspark.Engine(model, optimizer=_optimizer("sgd"), strategy=strategy, grad_accum_steps=2)
        for i, (x, y) in enumerate(loader):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y), weight=len(x))
            if i % 2 == 1 or i + 1 == len(loader):
                engine.step()
        state = engine.full_state_dict()
        engine.close()
        return state
    opt = _optimizer("sgd")(model.parameters())
    batches = list(loader)
    for i in range(0, len(batches), 2):
        window = batches[i:i + 2]
        rows = sum(len(x) for x, _ in window)
        opt.zero_grad()
        sum(torch.nn.functional.mse_loss(model(x), y, reduction="sum") for x, y in window).div(rows).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["replicate", "zero3"])
def test_a_padding_batch_trains_nothing_whatever_weight_the_loop_reads_from_it(pool, strategy: str) -> None:
    """25 samples at 8: the last window is 8 + 1 samples, and rank 1's half of the 1 is a padding copy
    of rank 0's sample. weight=len(x) there is 1, yet the step is one process's on the 9 samples: a
    padding batch weighs 0 (it weighed 1, training rank 0's sample twice, 1/10 of the step each)."""
    reference = _window_of_two(25, ranks=False)
    for state in pool.run(_window_of_two, 25, ranks=True, strategy=strategy):
        for name, want in reference.items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)
