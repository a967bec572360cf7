"""The engine turns on PyTorch's fused optimizer kernel only where the user left the choice open."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import dspark
from dspark.policy.optimizer_kernel import kernel_name, prefer_fused_kernel
from tests.messages import assert_names


def _params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 3, dtype=dtype)), nn.Parameter(torch.randn(3, dtype=dtype))]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_left_open_the_fused_kernel_is_chosen(cls: Any) -> None:
    opt = cls(_params(), lr=0.1)
    assert prefer_fused_kernel(opt)
    assert all(group["fused"] is True for group in opt.param_groups)


@pytest.mark.parametrize("choice", [{"fused": False}, {"foreach": True}, {"foreach": False}])
def test_a_users_choice_is_kept(choice: dict[str, bool]) -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1, **choice)
    assert not prefer_fused_kernel(opt)
    assert opt.param_groups[0]["fused"] is choice.get("fused")


def test_bf16_parameters_subclasses_and_other_optimizers_keep_the_loop() -> None:
    class MyAdamW(torch.optim.AdamW):
        pass

    for opt in (torch.optim.AdamW(_params(torch.bfloat16), lr=0.1), MyAdamW(_params(), lr=0.1),
                torch.optim.RMSprop(_params(), lr=0.1)):
        assert not prefer_fused_kernel(opt), type(opt).__name__


def test_one_group_with_a_choice_keeps_the_loop_for_all() -> None:
    a, b = _params()
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "foreach": True}], lr=0.1)
    assert not prefer_fused_kernel(opt)
    assert opt.param_groups[0]["fused"] is None


def test_kernel_name_says_what_the_step_runs() -> None:
    opt = torch.optim.AdamW(_params(), lr=0.1)
    assert kernel_name(opt) == "for-loop"  # PyTorch's own default for CPU tensors
    prefer_fused_kernel(opt)
    assert kernel_name(opt) == "fused"
    assert kernel_name(torch.optim.AdamW(_params(), lr=0.1, foreach=True)) == "foreach"
    a, b = _params()
    mixed = torch.optim.AdamW([{"params": [a], "fused": True}, {"params": [b]}], lr=0.1)
    assert kernel_name(mixed) == "for-loop + fused"


def test_the_engine_steps_adamw_fused_and_matches_the_loop(single_process) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    reference = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    assert engine.optimizer.param_groups[0]["fused"] is True
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    assert ref_opt.param_groups[0]["fused"] is None
    for step in range(5):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        ref_opt.zero_grad()
        reference(x).square().mean().backward()
        ref_opt.step()
    for (name, got), want in zip(engine.module.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
    engine.close()


class _LateBranch(nn.Module):
    """``b`` gets its first gradient at step 1: a branch skipped at first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.b(self.a(x)) if step > 0 else self.a(x)


def test_sgd_with_momentum_keeps_the_loop_for_momentum_that_starts_late(single_process) -> None:
    """Before: the fused SGD kernel failed at step 1 with a bare TypeError from torch."""
    assert prefer_fused_kernel(torch.optim.SGD(_params(), lr=0.1))  # without momentum: fused
    assert not prefer_fused_kernel(torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    torch.manual_seed(0)
    model = _LateBranch()
    reference = _LateBranch()
    reference.load_state_dict(model.state_dict())
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)
    engine = dspark.Engine(model, optimizer=sgd)
    ref_opt = sgd(reference.parameters())
    for step in range(4):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x, step).square().mean())
        engine.step()
        ref_opt.zero_grad()
        reference(x, step).square().mean().backward()
        ref_opt.step()
    for (name, got), want in zip(engine.module.state_dict().items(), reference.state_dict().values(),
                                 strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
    engine.close()


def test_a_param_groups_option_the_optimizer_lacks_is_named(single_process) -> None:
    """{"lrr": 0.1} was kept in its group and read by nobody, without a word; known options and
    the user's own keys on groups are still accepted (a warning, not an error)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    with pytest.warns(UserWarning) as warned:
        engine = dspark.Engine(model, optimizer=adamw,
                               param_groups=lambda n, p: {"lrr": 0.1} if p.ndim < 2 else None)
    (said,) = [str(w.message) for w in warned if "'lrr'" in str(w.message)]
    assert_names(said, "'lrr'", "0.bias, 1.bias", "AdamW", "weight_decay")
    assert [g.get("lrr") for g in engine.optimizer.param_groups] == [None, 0.1]
    engine.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dspark.Engine(nn.Linear(4, 2), optimizer=adamw,
                      param_groups=lambda n, p: {"weight_decay": 0.0} if p.ndim < 2 else {}).close()


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_native_bf16_is_warned(single_process, native: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU emulates bf16 (a matmul 43x slower than fp32 on one here): a step looked hung."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dspark.Engine(nn.Linear(4, 2), optimizer=sgd, precision="bf16").close()
        dspark.Engine(nn.Linear(4, 2), optimizer=sgd, precision="fp32").close()
    said = [str(w.message) for w in caught if "without native bf16" in str(w.message)]
    assert len(said) == (0 if native else 1), said
    if not native:
        assert_names(said[0], "precision='bf16'", "precision='fp32'")
