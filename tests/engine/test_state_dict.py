"""The engine's sharded state dict: its layout rules (no process group), and the structure it
hands to PyTorch's distributed checkpoint directly, on 2 ranks."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.engine.state_dict import is_per_element, rows_shape
from tests.engine import loop_models as lm


@pytest.mark.parametrize("shape,rows", [((), (1,)), ((5,), (5,)), ((7, 2), (7, 2)), ((0, 3), (0, 3))])
def test_rows_shape_gives_0d_parameters_one_row(shape: tuple[int, ...], rows: tuple[int, ...]) -> None:
    assert rows_shape(shape) == rows


@pytest.mark.parametrize("key,value_shape,param_shape,per_element", [
    ("exp_avg", (7, 2), (7, 2), True),
    ("exp_avg_sq", (3,), (3,), True),
    ("step", (), (7, 2), False),
    ("step", (), (), False),          # 0-d parameter: step is the scalar ...
    ("exp_avg", (), (), True),        # ... and exp_avg is per-element, by its key
    ("momentum", (1,), (3,), False),  # another shape: replicated as it is
])
def test_per_element_state_is_told_from_scalars(key: str, value_shape: tuple[int, ...],
                                                param_shape: tuple[int, ...], per_element: bool) -> None:
    assert is_per_element(key, value_shape, param_shape) is per_element



SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _steps(engine: dspark.Engine, first: int, last: int) -> None:
    for step in range(first, last):
        x, y = dspark.distribute_batch(lm.batch(step), shard_dim=0)
        engine.backward(lm.loss_fn(engine(x), y))
        engine.step()


def _through_plain_dcp(directory: str, save_strategy: str, load_strategy: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    engine = dspark.Engine(lm.build(), optimizer=SGD, strategy=save_strategy)
    _steps(engine, 0, 2)
    structure = {k: sorted(v) if isinstance(v, dict) else v for k, v in engine.sharded_state_dict().items()}
    dcp.save(engine.sharded_state_dict(), checkpoint_id=directory)
    engine.close()
    fresh = dspark.Engine(lm.build(seed=5), optimizer=SGD, strategy=load_strategy)
    _steps(fresh, 0, 1)  # momentum buffers exist, so the load fills them in place
    sd = fresh.sharded_state_dict()
    dcp.load(sd, checkpoint_id=directory)
    fresh.load_sharded_state_dict(sd)
    _steps(fresh, 2, 4)
    state = fresh.full_state_dict()
    fresh.close()
    return {"state": state, "structure": structure}


@pytest.mark.parametrize("save_strategy,load_strategy", [("zero3", "replicate"), ("zero1", "zero3")])
def test_torch_dcp_saves_and_loads_the_sharded_state_dict_directly(pool, tmp_path: Path, save_strategy: str,
                                                                   load_strategy: str) -> None:
    model = lm.build()
    optimizer = SGD([p for p in model.parameters() if p.requires_grad])
    for step in range(4):
        x, y = lm.batch(step)
        optimizer.zero_grad()
        lm.loss_fn(model(x), y).backward()
        optimizer.step()
    reference = model.state_dict()
    for result in pool.run(_through_plain_dcp, str(tmp_path / "dcp"), save_strategy, load_strategy):
        assert result["structure"]["model"][:2] == ["blocks.0.fc.bias", "blocks.0.fc.weight"]
        assert lm.max_rel_error(result["state"], reference) <= 2e-5
