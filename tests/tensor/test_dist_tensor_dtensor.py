"""``DistTensor.to_dtensor`` / ``from_dtensor``: PyTorch's DTensor agrees with DSpark's layout.

Runs on the 2-rank gloo pool; the uneven cases check that both use the same split rule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

import dspark
from dspark import comm
from dspark.tensor import REPLICATE, DistTensor, Replicate, Shard

CASES = [((6, 4), 0), ((6, 4), 1), ((7, 3), 0), ((3, 5), 1), ((1, 3), 0), ((0, 3), 0),
         ((7, 3), REPLICATE)]


def _whole(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).view(shape)


def _to_dtensor_and_back() -> list[dict[str, Any]]:
    out = []
    for shape, shard_dim in CASES:
        t = _whole(shape)
        x = dspark.distribute_tensor(t, shard_dim=shard_dim)
        d = x.to_dtensor()
        back = DistTensor.from_dtensor(d)
        out.append({
            "case": (shape, shard_dim), "is_dtensor": isinstance(d, DTensor),
            "placements": tuple(d.placements), "shape": tuple(d.shape),
            "full_tensor_equal": torch.equal(d.full_tensor(), t),
            "to_local_equal": torch.equal(d.to_local(), x.local),
            "shares_storage": x.local.numel() == 0
            or d.to_local().data_ptr() == x.local.data_ptr(),
            "back_placement": back.placement, "back_full_equal": torch.equal(back.full(), t),
        })
    return out


def _from_torch_distribute_tensor() -> list[dict[str, Any]]:
    mesh = comm.device_mesh()
    out = []
    for shape, placement in [((7, 3), TorchShard(0)), ((4, 5), TorchShard(1)),
                             ((4, 5), TorchShard(-1)), ((1, 2), TorchShard(0)),
                             ((4, 5), TorchReplicate())]:
        t = _whole(shape)
        d = torch_distribute_tensor(t, mesh, [placement])
        x = DistTensor.from_dtensor(d)
        out.append({"case": (shape, repr(placement)), "placement": x.placement,
                    "local_equal": torch.equal(x.local, d.to_local()),
                    "full_equal": torch.equal(x.full(), t),
                    "round_trip_equal": torch.equal(x.to_dtensor().full_tensor(), t)})
    return out


def _partial_placement_is_refused() -> str:
    d = DTensor.from_local(torch.ones(2), comm.device_mesh(), [Partial()])
    try:
        DistTensor.from_dtensor(d)
    except ValueError as exc:
        return str(exc)
    return ""


def _two_dim_mesh_is_refused() -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    d = DTensor.from_local(torch.ones(2, 3), mesh, [TorchShard(0), TorchReplicate()])
    try:
        DistTensor.from_dtensor(d)
    except ValueError as exc:
        return str(exc)
    return ""


def test_to_dtensor_keeps_placement_and_full_tensor_equals_the_original(pool) -> None:
    for rank, results in enumerate(pool.run(_to_dtensor_and_back)):
        for got in results:
            _, shard_dim = got["case"]
            assert got["is_dtensor"], got
            sharded = isinstance(shard_dim, int)
            want = (TorchShard(shard_dim),) if sharded else (TorchReplicate(),)
            assert got["placements"] == want, (rank, got)
            assert got["shape"] == got["case"][0], (rank, got)
            assert got["full_tensor_equal"] and got["to_local_equal"], (rank, got)
            assert got["shares_storage"], (rank, got)
            assert got["back_placement"] == (Shard(shard_dim) if sharded else Replicate()), got
            assert got["back_full_equal"], (rank, got)


def test_from_dtensor_wraps_torchs_own_distribute_tensor(pool) -> None:
    want = [Shard(0), Shard(1), Shard(1), Shard(0), Replicate()]
    for rank, results in enumerate(pool.run(_from_torch_distribute_tensor)):
        assert [got["placement"] for got in results] == want, rank
        for got in results:
            assert got["local_equal"] and got["full_equal"] and got["round_trip_equal"], (rank, got)


def test_from_dtensor_refuses_a_partial_placement(pool) -> None:
    for message in pool.run(_partial_placement_is_refused):
        assert "Partial" in message and "no DSpark equivalent" in message
        assert "Replicate()" in message, "the message names the fix"


def test_from_dtensor_refuses_a_two_dim_mesh(pool) -> None:
    for message in pool.run(_two_dim_mesh_is_refused):
        assert "2-D mesh" in message and "1-D" in message


def test_to_dtensor_needs_a_process_group(single_process) -> None:
    x = dspark.distribute_tensor(torch.ones(4, 2), shard_dim=0)
    with pytest.raises(dspark.CollectiveError, match="single-process stand-in"):
        x.to_dtensor()
