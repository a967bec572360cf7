"""zero3's default units: every child of a ModuleList/Sequential, split further inside a unit only
into pieces worth a collective of their own (pure logic); and a model whose default units both
merge a small nested container and keep a large one trains on 2 ranks as one process does, with
SGD (scale-sensitive) and AdamW."""

from __future__ import annotations

import functools
import platform
from typing import Any

import pytest
import torch
from torch import nn

import dspark
from dspark.engine.engine import engine_parts
from dspark.engine.zero3_units import MIN_NESTED_UNIT_BYTES, unit_modules


class _Block(nn.Module):
    """A residual block whose shortcut is a small Sequential (a ResNet's projection shortcut)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.shortcut = nn.Sequential(nn.Linear(width, width, bias=False), nn.LayerNorm(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x)) + self.shortcut(x)


def _names(model: nn.Module, policy=None) -> list[str]:
    return [name for name, _ in unit_modules(model, policy)]


def test_small_containers_inside_a_unit_stay_with_it() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(_Block(8), _Block(8)))
    # before the floor: "1.0", "1.0.shortcut.0", "1.0.shortcut.1", ... each its own all-gather
    assert _names(model) == ["", "0", "1"]


def test_nested_pieces_of_at_least_the_floor_are_units() -> None:
    width = 512  # 512 x 512 fp32 = 1 MiB per Linear
    assert width * width * 4 >= MIN_NESTED_UNIT_BYTES
    model = nn.Sequential(nn.Sequential(_Block(width), _Block(width)), nn.Linear(width, 2))
    assert sorted(_names(model)) == ["", "0", "0.0", "0.0.shortcut.0", "0.1", "0.1.shortcut.0", "1"]


def test_top_level_blocks_are_units_however_small() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
    assert _names(model) == ["", "0", "1", "2"]


def test_an_explicit_policy_is_taken_as_given() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(_Block(8), _Block(8)))
    assert _names(model, [nn.LayerNorm]) == ["", "1.0.shortcut.1", "1.1.shortcut.1"]


OPTIMIZERS = {"sgd": functools.partial(torch.optim.SGD, lr=0.05),
              "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)}
WIDE, NARROW = 512, 16
STEPS = 3
# float32 sums of halves over 2 ranks, a few steps; a factor of 2 on any gradient moves SGD's
# parameters by ~1e-2 relative
TOLERANCE = 2e-5


def _mixed_model() -> nn.Module:
    """Wide blocks (nested units of their own, 1 MiB Linears) beside narrow ones (merged)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NARROW, WIDE),
                         nn.Sequential(_Block(WIDE), _Block(WIDE)),
                         nn.Linear(WIDE, NARROW),
                         nn.Sequential(_Block(NARROW), _Block(NARROW)),
                         nn.Linear(NARROW, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, NARROW, generator=g), torch.randint(0, 4, (8,), generator=g)


def _reference(opt: str) -> dict[str, torch.Tensor]:
    model = _mixed_model()
    optimizer = OPTIMIZERS[opt](model.parameters())
    for step in range(STEPS):
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero3(opt: str) -> dict[str, Any]:
    model = _mixed_model()
    engine = dspark.Engine(model, optimizer=OPTIMIZERS[opt], strategy="zero3")
    zero3 = engine_parts(engine).zero3
    units = [unit.name for unit in zero3.units] if zero3 is not None else []
    for step in range(STEPS):
        x, y = dspark.distribute_batch(_batch(step), shard_dim=0)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    state = engine.full_state_dict()
    engine.close()
    return {"units": units, "state": state}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_default_units_that_merge_and_keep_nested_pieces_train_like_one_process(pool, opt: str) -> None:
    want = _reference(opt)
    for result in pool.run(_zero3, opt):
        assert sorted(result["units"]) == ["", "0", "1", "1.0", "1.0.shortcut.0", "1.1",
                                           "1.1.shortcut.0", "2", "3", "4"]
        for key, value in want.items():
            got = result["state"][key]
            error = float((got.double() - value.double()).norm() / max(float(value.double().norm()), 1e-6))
            assert error <= TOLERANCE, f"{key} under {opt}: relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_gather_tag_travels_exactly_in_any_parameter_dtype(dtype: torch.dtype) -> None:
    from dspark.engine.zero3_gather import tag_tensor, tags_of

    tags = [(3 << 48) | (17 << 24) | 16_777_215, (1 << 48) | 5]  # all-ones low bits: NaN patterns
    rows = torch.stack([tag_tensor(tag, dtype, torch.device("cpu")) for tag in tags])
    assert rows.dtype == dtype and rows.numel() * rows.element_size() == 2 * 8
    assert tags_of(rows).tolist() == tags


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc on Linux")
def test_a_gathered_storage_the_c_library_maps_apart_gets_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """zero3 faults each gathered storage of at least the mmap threshold in afresh at every gather:
    it is advised to huge pages before it is written ([Note: huge pages for mapped storages])."""
    from dspark import cpu_malloc
    from dspark.engine.zero3_gather import _fresh_full
    from tests.test_cpu_malloc import vm_flags

    monkeypatch.setattr(cpu_malloc, "_state", cpu_malloc.CpuMalloc("tuned"))
    shard = torch.empty(20 << 18)  # 20 MiB of float32 on each of 2 ranks: 40 MiB gathered
    full = _fresh_full(shard, 2)
    assert full.numel() == 2 * shard.numel()
    assert "hg" in vm_flags(full.data_ptr() + full.numel() * 2)  # its middle: the ends are partial 2 MiB pages


def _units_started_ahead(max_bytes: int) -> list[int]:
    """For each unit's forward (from the second step on, when the order is known): how many units
    after it already have their gather started (in flight or landed) when its own forward begins."""
    from dspark.engine import zero3_units

    zero3_units.SECOND_PREFETCH_MAX_BYTES = max_bytes  # this worker's module only
    try:
        torch.manual_seed(0)
        blocks = [nn.Linear(32, 32) for _ in range(6)]
        engine = dspark.Engine(nn.Sequential(*blocks), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                               strategy="zero3")
        x = dspark.distribute_batch(torch.randn(4, 32), shard_dim=0)
        for _ in range(2):  # the first step observes the order that prefetching follows
            engine.backward(engine(x).square().mean())
            engine.step()
        zero3 = engine_parts(engine).zero3
        assert zero3 is not None
        slots_of = {id(unit.module): unit.slots for unit in zero3.units}
        ahead: list[int] = []

        def count(module: nn.Module, args: Any) -> None:
            later = blocks[blocks.index(module) + 1:]  # type: ignore[arg-type]
            ahead.append(sum(all(s.gathered or s.pending is not None for s in slots_of[id(b)])
                             for b in later))

        # registered after the engine's hooks, so each runs once the engine gathered and prefetched
        handles = [b.register_forward_pre_hook(count) for b in blocks]
        engine.backward(engine(x).square().mean())
        engine.step()
        for handle in handles:
            handle.remove()
        engine.close()
        return ahead
    finally:
        zero3_units.SECOND_PREFETCH_MAX_BYTES = 16 << 20


def test_small_units_are_gathered_two_ahead_and_large_ones_one(pool) -> None:
    # a 32 x 32 Linear: 4.2 KB of parameters, a small unit
    for ahead in pool.run(_units_started_ahead, 16 << 20):
        assert ahead == [2, 2, 2, 2, 1, 0], ahead
    for ahead in pool.run(_units_started_ahead, 1024):  # every unit above the limit
        assert ahead == [1, 1, 1, 1, 1, 0], ahead
