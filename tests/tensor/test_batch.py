"""``distribute_batch``: every rank keeps its rows of every tensor, containers and other leaves kept.

Structure and divisibility run on the 2-rank gloo pool; errors that do not depend on the world
size run on the world-size-1 stand-in.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import dspark
from dspark.tensor import REPLICATE, PlacementError
from tests.messages import assert_line_names


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def _global_batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(rows * 3.0).view(rows, 3), torch.arange(rows)


def _rows(t: torch.Tensor) -> list[Any]:
    return t.tolist()


# -- tasks run on every rank -------------------------------------------------------------------
def _batch_structures() -> dict[str, Any]:
    x, y = _global_batch()
    opaque = object()  # a non-tensor leaf: passed through as the same object
    nested = {"inputs": (x, [y]), "name": "run-1", "step": 3, "meta": {"run": "seed"},
              "opaque": opaque, "none": None}
    tensor = dspark.distribute_batch(x, shard_dim=0)
    as_tuple = dspark.distribute_batch((x, y), shard_dim=0)
    as_list = dspark.distribute_batch([x, y, "tag"], shard_dim=0)
    as_dict = dspark.distribute_batch(OrderedDict(x=x, y=y), shard_dim=0)
    as_nested = dspark.distribute_batch(nested, shard_dim=0)
    as_pair = dspark.distribute_batch(Pair(x, y), shard_dim=0)
    as_default = dspark.distribute_batch(defaultdict(list, x=x), shard_dim=0)
    columns = dspark.distribute_batch((x.T, y), shard_dim=-1)  # dim 1 of (3, 8), dim 0 of (8,)
    whole = (x, y)
    replicated = dspark.distribute_batch(whole, shard_dim=REPLICATE)
    return {
        "tensor": _rows(tensor),
        "tuple": (type(as_tuple).__name__, _rows(as_tuple[0]), _rows(as_tuple[1])),
        "list": (type(as_list).__name__, _rows(as_list[0]), _rows(as_list[1]), as_list[2]),
        "dict": (type(as_dict).__name__, list(as_dict), _rows(as_dict["x"]), _rows(as_dict["y"])),
        "nested": (type(as_nested["inputs"]).__name__, type(as_nested["inputs"][1]).__name__,
                   _rows(as_nested["inputs"][0]), _rows(as_nested["inputs"][1][0]),
                   as_nested["name"], as_nested["step"], as_nested["meta"],
                   as_nested["opaque"] is opaque, as_nested["none"], len(nested["inputs"][0])),
        "pair": (type(as_pair).__name__, _rows(as_pair.x), _rows(as_pair.y)),
        "defaultdict": (type(as_default).__name__, as_default.default_factory is list,
                        _rows(as_default["x"])),
        "columns": (_rows(columns[0]), _rows(columns[1])),
        "replicated": replicated is whole,
    }


def _uneven_batches() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rows in (7, 1):
        x, y = _global_batch(rows)
        try:
            dspark.distribute_batch((x, y), shard_dim=0)
            out[f"error_{rows}"] = ""
        except PlacementError as exc:
            out[f"error_{rows}"] = str(exc)
        lx, ly = dspark.distribute_batch((x, y), shard_dim=0, allow_uneven=True)
        out[f"uneven_{rows}"] = (_rows(lx), _rows(ly))
    empty = dspark.distribute_batch(_global_batch(0), shard_dim=0)
    out["empty"] = [tuple(t.shape) for t in empty]
    return out


@dataclasses.dataclass(frozen=True)
class Sample:
    x: torch.Tensor
    labels: np.ndarray
    note: str = "kept"


def _per_sample_values() -> dict[str, Any]:
    """What sits beside the tensors with one value per sample: numpy labels, raw texts, ids."""
    x, _ = _global_batch()
    texts = [f"text {i}" for i in range(8)]
    got = dspark.distribute_batch({"x": x, "labels": np.arange(8), "texts": texts,
                                   "ids": tuple(range(100, 108)), "classes": ["cat", "dog"]},
                                  shard_dim=0)
    numpy_only = dspark.distribute_batch((np.arange(8.0), np.arange(16).reshape(8, 2)), shard_dim=0)
    in_dataclass = dspark.distribute_batch([Sample(x, np.arange(8))], shard_dim=0)[0]
    return {
        "x": _rows(got["x"]), "labels": got["labels"].tolist(), "texts": got["texts"],
        "ids": got["ids"], "classes": got["classes"],
        "numpy": (numpy_only[0].tolist(), numpy_only[1].tolist()),
        "dataclass": (type(in_dataclass).__name__, _rows(in_dataclass.x),
                      in_dataclass.labels.tolist(), in_dataclass.note),
        "mismatch": _error_text(lambda: dspark.distribute_batch((x, np.arange(6)), shard_dim=0)),
    }


def _error_text(fn: Any) -> str:
    try:
        fn()
    except PlacementError as exc:
        return str(exc)
    return "no error"


# -- tests on the pool -------------------------------------------------------------------------
def test_per_sample_values_beside_the_tensors_are_split_with_them(pool) -> None:
    """numpy arrays and lists as long as the batch hold one value per sample: a rank that kept all
    of them would pair its rows with other rows' labels (a silent copy, what placements refuse)."""
    x, _ = _global_batch()
    for rank, got in enumerate(pool.run(_per_sample_values)):
        rows = range(4 * rank, 4 * rank + 4)
        assert got["x"] == x[4 * rank:4 * rank + 4].tolist()
        assert got["labels"] == list(rows)
        assert got["texts"] == [f"text {i}" for i in rows]
        assert got["ids"] == tuple(100 + i for i in rows)
        assert got["classes"] == ["cat", "dog"], "a list of another length passes through"
        assert got["numpy"] == ([float(i) for i in rows], [[2 * i, 2 * i + 1] for i in rows])
        assert got["dataclass"] == ("Sample", x[4 * rank:4 * rank + 4].tolist(), list(rows), "kept")
        assert "has 6 rows along dim 0" in got["mismatch"], got["mismatch"]


def test_each_rank_keeps_its_rows_of_every_container(pool) -> None:
    x, y = _global_batch()
    for rank, got in enumerate(pool.run(_batch_structures)):
        rows = slice(4 * rank, 4 * rank + 4)
        mine_x, mine_y = x[rows].tolist(), y[rows].tolist()
        assert got["tensor"] == mine_x
        assert got["tuple"] == ("tuple", mine_x, mine_y)
        assert got["list"] == ("list", mine_x, mine_y, "tag")
        assert got["dict"] == ("OrderedDict", ["x", "y"], mine_x, mine_y)
        assert got["nested"] == ("tuple", "list", mine_x, mine_y, "run-1", 3, {"run": "seed"}, True, None, 8)
        assert got["pair"] == ("Pair", mine_x, mine_y)
        assert got["defaultdict"] == ("defaultdict", True, mine_x)
        assert got["columns"] == (x.T[:, rows].tolist(), mine_y)
        assert got["replicated"], "REPLICATE keeps the whole batch as it is"


def test_a_batch_not_divisible_by_the_world_size_fails_unless_allowed(pool) -> None:
    x7, y7 = _global_batch(7)
    x1, y1 = _global_batch(1)
    r0, r1 = pool.run(_uneven_batches)
    for got in (r0, r1):
        message = got["error_7"]
        assert_line_names(message, "global batch of 7", "dim 0", "world size 2")
        assert_line_names(message, "6 or 8", "allow_uneven=True")
        assert_line_names(got["error_1"], "batch of 2", "allow_uneven=True")
        assert got["empty"] == [(0, 3), (0,)]
    # allow_uneven follows the documented rule: ceil chunks, first ranks first.
    assert r0["uneven_7"] == (x7[:4].tolist(), y7[:4].tolist())
    assert r1["uneven_7"] == (x7[4:].tolist(), y7[4:].tolist())
    assert r0["uneven_1"] == (x1.tolist(), y1.tolist())
    assert r1["uneven_1"] == ([], [])


# -- the world-size-1 stand-in -----------------------------------------------------------------
def test_single_process_keeps_the_whole_batch(single_process) -> None:
    x, y = _global_batch(7)
    lx, ly = dspark.distribute_batch((x, y), shard_dim=0)  # 7 divides by a world of 1
    assert torch.equal(lx, x) and torch.equal(ly, y)
    got = dspark.distribute_batch({"x": x, "pair": Pair(x, y)}, shard_dim=0)
    assert torch.equal(got["x"], x) and isinstance(got["pair"], Pair)
    # A negative dim counts from each tensor's own end: (3, 7) and (7,) both split their 7.
    columns, labels = dspark.distribute_batch((x.T, y), shard_dim=-1)
    assert torch.equal(columns, x.T) and torch.equal(labels, y)


BAD_BATCHES = [
    ((torch.ones(4, 3), torch.ones(5)), 0, PlacementError,
     r"batch\[1\] has 5 rows along dim 0, but batch\[0\] has 4: every tensor of a batch"),
    ({"x": torch.ones(4, 3), "y": {"z": torch.ones(4, 2)}}, 1, PlacementError,
     r"batch\['y'\]\['z'\] has 2 rows along dim 1, but batch\['x'\] has 3"),
    ((torch.ones(4, 3), torch.ones(4)), 1, PlacementError,
     r"batch\[1\] of shape \(4,\): shard_dim=1 is out of range"),
    ((torch.ones(4, 3),), None, PlacementError, r"batch\[0\] of shape \(4, 3\): shard_dim=None"),
    (torch.ones(4), "0", PlacementError, "shard_dim='0'"),
    (("a", 1, [None]), 0, TypeError, "found no tensor in a tuple"),
    ({}, REPLICATE, TypeError, "found no tensor in a dict"),
    ([1.0, 2.0], 0, TypeError, "found no tensor in a list"),
]


def test_bad_batches_raise_with_the_values(single_process) -> None:
    # One test, not a parametrisation: setting up the stand-in costs more than the checks.
    for batch, shard_dim, error, match in BAD_BATCHES:
        with pytest.raises(error, match=match):
            dspark.distribute_batch(batch, shard_dim=shard_dim)
