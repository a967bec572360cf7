"""The optimizer hyper-parameters the ranks compare at each step (no process group)."""

from __future__ import annotations

import pickle

import torch

from dspark.engine.hyperparams import differences, fingerprint, hyperparameters


def _adamw(**options: object) -> torch.optim.Optimizer:
    w, b = torch.zeros(3, requires_grad=True), torch.zeros(1, requires_grad=True)
    groups = [{"params": [w]}, {"params": [b], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, **options)  # type: ignore[arg-type]


def test_every_entry_of_every_group_but_params_counts() -> None:
    groups = hyperparameters(_adamw(lr=0.1))
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert all("params" not in g and g["lr"] == 0.1 and g["betas"] == (0.9, 0.999) for g in groups)


def test_the_fingerprint_changes_with_any_value_and_only_then() -> None:
    base = fingerprint(_adamw(lr=0.1))
    assert fingerprint(_adamw(lr=0.1)) == base and base < 2**53  # exact in the reduction's float64
    for changed in ({"lr": 0.2}, {"betas": (0.8, 0.999)}, {"eps": 1e-6}, {"weight_decay": 0.1}):
        assert fingerprint(_adamw(**{"lr": 0.1, **changed})) != base, changed
    opt = _adamw(lr=0.1)
    opt.param_groups[1]["lr"] = torch.tensor(0.25)  # a CPU tensor reads as its value
    assert hyperparameters(opt)[1]["lr"] == 0.25


def test_differences_name_the_group_the_key_and_each_ranks_value() -> None:
    mine = hyperparameters(_adamw(lr=0.1))
    theirs = hyperparameters(_adamw(lr=0.1))
    theirs[1]["momentum"] = 0.9
    theirs[0]["lr"] = 1.0
    assert differences([mine, theirs]) == ["param group 0 'lr': 0.1 on rank 0, 1.0 on rank 1",
                                           "param group 1 'momentum': '(not set)' on rank 0, 0.9 on rank 1"]
    assert differences([mine, mine[:1]]) == ["param groups: 2 on rank 0, 1 on rank 1"]
    assert differences([mine, mine]) == []


class _Tag:
    """An object of the program's kept in a param group: its repr names its address."""


def test_an_object_in_a_group_compares_without_its_address() -> None:
    # two processes hold the same program's objects at different addresses: two instances here
    mine, theirs = _adamw(lr=0.1), _adamw(lr=0.1)
    mine.param_groups[0]["tag"], theirs.param_groups[0]["tag"] = _Tag(), _Tag()
    mine.param_groups[1]["hook"], theirs.param_groups[1]["hook"] = lambda lr: lr, lambda lr: lr
    assert fingerprint(mine) == fingerprint(theirs)
    assert pickle.loads(pickle.dumps(hyperparameters(mine))) == hyperparameters(theirs)  # gathered as is
    theirs.param_groups[0]["tag"] = 1.0
    assert fingerprint(mine) != fingerprint(theirs)
