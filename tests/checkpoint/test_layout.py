"""The checkpoint layout rules, with no process group."""

from __future__ import annotations

from dspark.checkpoint import layout
from tests.messages import assert_names


def test_keys_keep_parameter_names_whole() -> None:
    assert layout.model_key("layers.0.weight") == "model/layers.0.weight"
    assert layout.optim_key("layers.0.weight", "exp_avg") == "optim/layers.0.weight/exp_avg"
    # a prefix never matches a longer name that starts the same way
    assert not layout.optim_key("layers.0.weight2", "step").startswith(layout.optim_prefix("layers.0.weight"))


def test_first_mismatch_names_the_first_differing_parameter_in_model_order() -> None:
    saved = {"a": (2, 3), "b": (4,), "c": (5,)}
    assert layout.first_mismatch([("a", (2, 3)), ("b", (4,)), ("c", (5,))], saved) is None
    assert layout.first_mismatch([("a", (2, 3)), ("b", (5,)), ("c", (6,))], saved) == (
        "parameter 'b' has shape (5,) in the model but (4,) in the checkpoint")
    missing = layout.first_mismatch([("a", (2, 3)), ("z", (1,))], saved)
    assert missing is not None and missing.startswith("parameter 'z' (1,) "), missing
    assert_names(missing, "not in the checkpoint")
    extra = layout.first_mismatch([("a", (2, 3)), ("b", (4,))], saved)
    assert extra is not None
    assert_names(extra, "'c'", "(5,)")


def test_tied_aliases_in_a_checkpoint_are_not_extra() -> None:
    saved = {"embed.weight": (11, 6), "head.weight": (11, 6)}  # written by an untied model
    assert layout.first_mismatch([("embed.weight", (11, 6))], saved, aliases=["head.weight"]) is None
