"""The checkpoint layout rules, with no process group."""

from __future__ import annotations

import pytest

from dspark.checkpoint import layout


def test_keys_keep_parameter_names_whole() -> None:
    assert layout.model_key("layers.0.weight") == "model/layers.0.weight"
    assert layout.optim_key("layers.0.weight", "exp_avg") == "optim/layers.0.weight/exp_avg"
    # a prefix never matches a longer name that starts the same way
    assert not layout.optim_key("layers.0.weight2", "step").startswith(layout.optim_prefix("layers.0.weight"))


@pytest.mark.parametrize("shape,rows", [((), (1,)), ((5,), (5,)), ((7, 2), (7, 2)), ((0, 3), (0, 3))])
def test_rows_shape_gives_0d_parameters_one_row(shape: tuple[int, ...], rows: tuple[int, ...]) -> None:
    assert layout.rows_shape(shape) == rows


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
    assert layout.is_per_element(key, value_shape, param_shape) is per_element


def test_first_mismatch_names_the_first_differing_parameter_in_model_order() -> None:
    saved = {"a": (2, 3), "b": (4,), "c": (5,)}
    assert layout.first_mismatch([("a", (2, 3)), ("b", (4,)), ("c", (5,))], saved) is None
    assert layout.first_mismatch([("a", (2, 3)), ("b", (5,)), ("c", (6,))], saved) == (
        "parameter 'b' has shape (5,) in the model but (4,) in the checkpoint")
    missing = layout.first_mismatch([("a", (2, 3)), ("z", (1,))], saved)
    assert missing is not None and missing.startswith("parameter 'z' (1,) is not in the checkpoint")
    extra = layout.first_mismatch([("a", (2, 3)), ("b", (4,))], saved)
    assert extra is not None and "holds parameter 'c' (5,) that the model does not have" in extra


def test_tied_aliases_in_a_checkpoint_are_not_extra() -> None:
    saved = {"embed.weight": (11, 6), "head.weight": (11, 6)}  # written by an untied model
    assert layout.first_mismatch([("embed.weight", (11, 6))], saved, aliases=["head.weight"]) is None
