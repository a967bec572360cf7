"""Non-tensor checkpoint values as JSON: exact round trips, and nothing decoded that was not written."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark.checkpoint.json_values import decode, encode
from tests.messages import assert_names


def _round_trip(value: object) -> object:
    return decode(json.loads(json.dumps(encode(value), allow_nan=False)))


def test_an_adamw_param_group_comes_back_with_its_types() -> None:
    group = {k: v for k, v in torch.optim.AdamW([torch.zeros(2)], lr=3e-4).param_groups[0].items()
             if k != "params"}
    back = _round_trip(group)
    assert back == group and isinstance(back, dict)
    assert isinstance(back["betas"], tuple) and back["betas"] == (0.9, 0.999)
    assert all(type(back[k]) is type(group[k]) for k in group)


@pytest.mark.parametrize("value", [None, True, 0, -7, 2**62, 0.1, 1e-300, "x", [1, (2, 3)],
                                   {"a": {"b": [None]}}, {"__tuple__": [1]}])
def test_plain_values_round_trip_exactly(value: object) -> None:
    assert _round_trip(value) == value


def test_dicts_with_other_keys_and_counters_come_back_as_they_were() -> None:
    """MultiStepLR keeps its milestones as a Counter of ints, which it indexes with missing keys: it
    must come back a Counter, with int keys."""
    import collections

    milestones = torch.optim.lr_scheduler.MultiStepLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), milestones=[30, 80]).state_dict()
    back = _round_trip(milestones)
    assert back == milestones and type(back["milestones"]) is collections.Counter  # type: ignore[index]
    assert back["milestones"][31] == 0  # type: ignore[index]
    mixed = {1: "a", 2.5: None, None: [1], (1, "x"): {"k": (2,)}, False: 0}
    assert _round_trip(mixed) == mixed


def test_non_finite_floats_and_dtypes() -> None:
    assert _round_trip(math.inf) == math.inf and _round_trip(-math.inf) == -math.inf
    assert math.isnan(_round_trip(math.nan))  # type: ignore[arg-type]
    assert _round_trip(torch.bfloat16) is torch.bfloat16


@pytest.mark.parametrize("tensor", [torch.tensor(3e-4), torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
                                    torch.arange(6, dtype=torch.int64).reshape(2, 3),
                                    torch.tensor(1 / 3, dtype=torch.float64)])
def test_small_tensors_round_trip_bit_for_bit(tensor: torch.Tensor) -> None:
    back = _round_trip(tensor)
    assert isinstance(back, torch.Tensor) and back.dtype == tensor.dtype
    assert torch.equal(back, tensor)


def test_what_json_cannot_hold_is_named() -> None:
    with pytest.raises(TypeError) as caught:
        encode({"fn": lambda: 0}, "group")
    assert_names(str(caught.value), "group['fn']", "function")
    with pytest.raises(TypeError) as caught:
        encode({frozenset(): 2}, "group")
    assert_names(str(caught.value), "group", "frozenset")
    with pytest.raises(TypeError, match="tensor of 5000 elements"):
        encode(torch.zeros(5000))


@pytest.mark.parametrize("data", [{"__reduce__": ["os.system", "touch x"]}, {"__tensor__": {"dtype": "load"}},
                                  {"__dtype__": "load"}, {"__float__": "1e999"}, {"a": 1, "b": 2},
                                  {"__items__": [[[1, 2], 3]]}, {"__items__": [[1]]}])
def test_anything_not_written_by_encode_is_refused(data: object) -> None:
    with pytest.raises(ValueError, match=r"is not|names dtype"):
        decode(data, "v")
