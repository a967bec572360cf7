"""`with dspark.meta_init():` — a model built with no parameter memory, materialised by the engine
(zero3 one unit at a time) with bitwise the values its own initialisation code gives on the CPU:
reset_parameters(), self.apply(fn), named_parameters() loops, HuggingFace's post_init(). What
cannot be replayed is refused before the first step, naming the parameter."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import dspark
from dspark.meta.record import meta_init, record_of, replay
from tests.engine import hf_models
from tests.engine.nanogpt_model import NanoGPT

SGD = functools.partial(torch.optim.SGD, lr=0.1)


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "nanogpt": NanoGPT,
    "gpt2": lambda: hf_models.gpt2(seed=0),
    "llama": lambda: hf_models.llama(seed=None),
}


def _build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name]()


def _meta_state(name: str, strategy: str) -> dict[str, torch.Tensor]:
    with dspark.meta_init():
        model = _build(name, seed=3)
    assert all(p.is_meta for p in model.parameters())
    engine = dspark.Engine(model, optimizer=SGD, strategy=strategy)
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_meta_init_model_equals_its_cpu_build_bitwise(pool, name: str, strategy: str) -> None:
    cpu = _build(name, seed=3).state_dict()
    for state in pool.run(_meta_state, name, strategy):
        assert state.keys() == cpu.keys()
        for key in cpu:
            assert state[key].dtype == cpu[key].dtype, key
            assert torch.equal(state[key], cpu[key]), key


def test_nanogpt_embedding_gets_its_own_std_not_the_default() -> None:
    torch.manual_seed(0)
    with meta_init():
        model = NanoGPT()
    wte = replay(record_of(model.lm_head.weight), "lm_head.weight")  # type: ignore[arg-type]
    assert 0.01 < float(wte.std()) < 0.03  # PyTorch's Embedding default would be 1.0


def test_the_random_stream_after_the_model_is_the_cpu_builds() -> None:
    _build("nanogpt", seed=5)
    cpu_next = torch.randn(4)
    with meta_init():
        _build("nanogpt", seed=5)
    assert torch.equal(torch.randn(4), cpu_next)


class _Mirrored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.mirror = nn.Parameter(torch.empty(4, 4))
        with torch.no_grad():
            self.mirror.copy_(self.proj.weight.t())  # another tensor's data: nothing to replay


def _unreproducible() -> str:
    with dspark.meta_init():
        model = _Mirrored()
    try:
        dspark.Engine(model, optimizer=SGD, strategy="zero3")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_initialisation_that_cannot_be_replayed_is_refused_naming_the_parameter(pool) -> None:
    for message in pool.run(_unreproducible):
        assert "mirror:" in message and "copy_" in message, message
        assert "proj" not in message.split("Nothing was")[0], message


def _plain_meta_nanogpt() -> str:
    with torch.device("meta"):
        model = NanoGPT()
    try:
        dspark.Engine(model, optimizer=SGD, strategy="zero3")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_plain_meta_device_with_init_outside_reset_parameters_is_refused(pool) -> None:
    for message in pool.run(_plain_meta_nanogpt):
        assert "NanoGPT.__init__" in message and "dspark.meta_init()" in message, message


def test_an_uninitialised_parameter_under_meta_init_is_an_error() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with meta_init():
        model = Bare()
    with pytest.raises(ValueError, match=r"^w \(shape \(3,\)\)"):
        replay(record_of(model.w), "w")  # type: ignore[arg-type]


def test_values_given_at_construction_and_partial_writes_are_kept() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(5000))
            self.scale = nn.Parameter(torch.tensor(1.5))
            self.table = nn.Embedding(6, 3, padding_idx=2)
            with torch.no_grad():
                self.table.weight[0].mul_(3.0)
                self.table.weight.data[4] = 7.0

    torch.manual_seed(1)
    cpu = Mixed().state_dict()
    torch.manual_seed(1)
    with meta_init():
        model = Mixed()
    for name, p in model.named_parameters():
        assert torch.equal(replay(record_of(p), name), cpu[name]), name  # type: ignore[arg-type]


class _TorchSkipsMeta(nn.Module):
    """torch.nn.init's orthogonal_, trunc_normal_ and sparse_ return at once on a meta tensor, drawing
    nothing: meta_init records the calls themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(4, 6))
        self.b = nn.Parameter(torch.empty(5, 3))
        self.c = nn.Parameter(torch.empty(6, 4))
        self.d = nn.Linear(3, 3)
        nn.init.orthogonal_(self.a)
        nn.init.trunc_normal_(self.b, std=0.02)
        nn.init.sparse_(self.c, sparsity=0.5)


def test_init_functions_that_skip_meta_tensors_are_replayed_bitwise() -> None:
    torch.manual_seed(4)
    cpu = _TorchSkipsMeta().state_dict()
    after = torch.randn(3)
    torch.manual_seed(4)
    with meta_init():
        model = _TorchSkipsMeta()
    assert torch.equal(torch.randn(3), after)
    for name, p in model.named_parameters():
        assert torch.equal(replay(record_of(p), name), cpu[name]), name  # type: ignore[arg-type]
