"""Placements as values, and ``to_placement`` failing closed. No process group."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dspark
from dspark.tensor import REPLICATE, PlacementError, Replicate, Shard, to_placement
from tests.messages import assert_names


def test_placements_are_frozen_values_with_machine_repr_and_human_str() -> None:
    assert repr(Shard(0)) == "Shard(dim=0)" and str(Shard(0)) == "S(0)"
    assert repr(Shard(dim=3)) == "Shard(dim=3)" and str(Shard(3)) == "S(3)"
    assert repr(Replicate()) == "Replicate()" and str(Replicate()) == "R"
    assert Shard(1) == Shard(dim=1) and hash(Shard(1)) == hash(Shard(dim=1))
    assert Shard(0) != Shard(1) and Shard(0) != Replicate()
    assert Replicate() == REPLICATE == dspark.REPLICATE and hash(Replicate()) == hash(REPLICATE)
    assert len({Shard(0), Shard(0), Shard(1), Replicate(), REPLICATE}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shard(0).dim = 1  # type: ignore[misc]
    # CPython reports a new attribute on a slotted frozen dataclass as TypeError, not
    # FrozenInstanceError; either way the value cannot change.
    with pytest.raises((AttributeError, TypeError)):
        REPLICATE.dim = 0  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(Shard(2))) == Shard(2)
    assert pickle.loads(pickle.dumps(REPLICATE)) == REPLICATE


@pytest.mark.parametrize("dim", [True, 0.0, "0", None])
def test_shard_rejects_a_non_int_dim(dim: object) -> None:
    with pytest.raises(PlacementError, match=repr(dim).replace(".", r"\.")):
        Shard(dim)  # type: ignore[arg-type]


@pytest.mark.parametrize(("shard_dim", "shape", "expected"), [
    (0, (4, 8), Shard(0)),
    (1, (4, 8), Shard(1)),
    (-1, (4, 8), Shard(1)),
    (-2, (4, 8), Shard(0)),
    (-1, (5,), Shard(0)),
    (Shard(1), (4, 8), Shard(1)),
    (Shard(-1), (2, 3, 4), Shard(2)),
    (REPLICATE, (4, 8), Replicate()),
    (Replicate(), (), Replicate()),  # a 0-d tensor can be replicated, only not split
])
def test_to_placement_accepts_ints_shards_and_replicate(
        shard_dim: object, shape: tuple[int, ...], expected: object) -> None:
    assert to_placement(shard_dim, shape) == expected


def test_to_placement_accepts_integral_non_python_ints() -> None:
    numpy = pytest.importorskip("numpy")
    assert to_placement(numpy.int64(-1), (2, 3)) == Shard(1)


def _assert_names_shape_value_and_both_fixes(message: str, shape: tuple[int, ...],
                                             value: object) -> None:
    assert f"shape {shape}" in message, message
    assert f"shard_dim={value!r}" in message, message
    assert "shard_dim=<int>" in message, message
    assert "shard_dim=dspark.REPLICATE" in message, message


@pytest.mark.parametrize("shard_dim", [None, True, False, 0.0, 1.0, "0", "replicate", [0], (0,)])
def test_to_placement_rejects_non_placements(shard_dim: object) -> None:
    shape = (4, 8)
    with pytest.raises(PlacementError) as info:
        to_placement(shard_dim, shape)
    assert isinstance(info.value, ValueError)  # callers may catch the builtin kind
    _assert_names_shape_value_and_both_fixes(str(info.value), shape, shard_dim)
    assert "[-2, 1]" in str(info.value)


def test_none_says_dspark_never_replicates_by_default() -> None:
    with pytest.raises(PlacementError, match="never replicates by default"):
        to_placement(None, (3,))


@pytest.mark.parametrize(("shard_dim", "shape"), [
    (2, (4, 8)), (-3, (4, 8)), (7, (4,)), (-2, (4,)), (Shard(2), (4, 8)), (Shard(-3), (4, 8)),
])
def test_to_placement_rejects_out_of_range_dims_of_both_signs(
        shard_dim: object, shape: tuple[int, ...]) -> None:
    with pytest.raises(PlacementError, match="out of range") as info:
        to_placement(shard_dim, shape)
    _assert_names_shape_value_and_both_fixes(str(info.value), shape, shard_dim)


@pytest.mark.parametrize("shard_dim", [0, -1, Shard(0), None, 0.0])
def test_to_placement_on_a_0d_tensor_only_allows_replicate(shard_dim: object) -> None:
    with pytest.raises(PlacementError) as info:
        to_placement(shard_dim, ())
    _assert_names_shape_value_and_both_fixes(str(info.value), (), shard_dim)
    assert "0-d" in str(info.value)


def test_to_placement_names_what_is_being_placed() -> None:
    with pytest.raises(PlacementError, match=r"^batch\[0\] of shape \(2, 3\)"):
        to_placement(None, torch.Size([2, 3]), what="batch[0]")


@settings(deadline=None, max_examples=200)
@given(shape=st.lists(st.integers(0, 5), min_size=1, max_size=5), offset=st.integers(-12, 12))
def test_to_placement_normalises_every_int_or_fails_closed(shape: list[int], offset: int) -> None:
    ndim = len(shape)
    if -ndim <= offset < ndim:
        assert to_placement(offset, shape) == Shard(offset % ndim)
        assert to_placement(Shard(offset), shape) == Shard(offset % ndim)
    else:
        with pytest.raises(PlacementError) as caught:
            to_placement(offset, shape)
        assert_names(str(caught.value), f"shard_dim={offset}", f"{ndim} dims")
