"""Hybrid sharding on real shard and replica groups: ``dspark run --nproc 4`` (2 groups of 2) and
``--nproc 6`` (3 x 2), one launch each for every variant (tests/engine/hybrid_ranks_worker.py). Every
inner stage trains as one process on the whole batch, with SGD and AdamW, clipped (the global norm
counts each shard once); a rank holds its shard group's share; a hybrid-zero3 checkpoint of 2 x 2
loads exactly under zero3 on 2 ranks (the pool) and replicate on 1, and a zero2 checkpoint of 4
ranks loads exactly into hybrid-zero3."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from tests.engine import loop_models as lm
from tests.engine.hybrid_ranks_worker import CLIP, GROUP, OPTIMIZERS, STAGES, reference

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hybrid_ranks_worker.py")
TOLERANCE = 2e-5


def _launch(tmp_path_factory: pytest.TempPathFactory, n: int) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"hybrid{n}") / "out.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", str(n), "--oversubscribe",
                           str(WORKER), str(out)], cwd=out.parent, env=env, capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {**torch.load(out, weights_only=False), "path": out}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return {n: _launch(tmp_path_factory, n) for n in (4, 6)}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[dict[str, torch.Tensor], list[float]]]:
    return {optimizer: reference(optimizer) for optimizer in OPTIMIZERS}


@pytest.mark.slow
@pytest.mark.parametrize("n", [4, 6])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_in_groups_of_two_trains_as_one_process(launches: dict, references: dict, n: int,
                                                            optimizer: str, stage: str) -> None:
    want, norms = references[optimizer]
    assert not torch.equal(want["embed.weight"], lm.build().embed.weight.detach())  # it trained
    assert norms[-1] > CLIP  # every step clipped
    got = launches[n]
    assert lm.max_rel_error(got["states"][(stage, optimizer)], want) <= TOLERANCE
    assert got["norms"][(stage, optimizer)] == pytest.approx([norms[-1]] * n, rel=1e-5)
    for rank, memory in enumerate(got["memory"][(stage, optimizer)]):
        assert memory["shard_group_size"] == GROUP
        for part in ("params", "grads", "optimizer"):  # a 1/2 share, not 1/n: the shard group's
            assert memory[f"{part}_bytes"] <= memory[f"{part}_bytes_expected"], (rank, part, memory)
    sent = got["bytes"][(stage, optimizer)]
    if stage != "zero1":  # zero1's whole gradients are all-reduced over the world, as under zero1
        assert sent["replica"]["all_reduce"] > 0  # the shards cross the groups
        assert sent["shard"]["reduce_scatter"] > 0
    if stage == "zero3":  # the gathers stay inside a group (the world's: the batch and step checks' few bytes)
        assert "all_gather" not in sent["replica"]
        assert sent["shard"]["all_gather"] > 20 * sent["world"].get("all_gather", 0)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint, whole, read offline."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dspark.checkpoint import storage

    metadata = storage.read_metadata(path)
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(("model/", "optim/")) and isinstance(meta, TensorStorageMetadata)}
    storage.read_state(state, path, metadata, distributed=False)
    return state


def _load_and_save(strategy: str, source: str, target: str) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(lm.build(seed=1), optimizer=OPTIMIZERS["adamw"], strategy=strategy,
                           clip_grad_norm=CLIP, bucket_mb=1e-4)
    engine.load(source)
    engine.save(target)
    state = engine.full_state_dict()
    engine.close()
    return state


def _assert_same_files(got: Path, want: Path) -> None:
    a, b = _tensors(got), _tensors(want)
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in b)
    different = [k for k in b if not torch.equal(a[k], b[k])]
    assert not different, different


@pytest.mark.slow
def test_a_hybrid_checkpoint_loads_exactly_under_zero3_on_two_ranks_and_replicate_on_one(
        launches: dict, pool: Any, single_process: Any, tmp_path: Path) -> None:
    source = Path(f"{launches[4]['path']}.hybrid.ckpt")
    saved = launches[4]["checkpoints"]["hybrid"]
    assert dspark.checkpoint.read_checkpoint_info(source).strategy == "hybrid-zero3"
    from dspark.checkpoint import storage

    stored = Counter(index.fqn for index in storage.read_metadata(source).storage_data)
    assert stored["model/embed.weight"] == stored["optim/embed.weight/exp_avg"] == GROUP  # each shard once
    for state in pool.run(_load_and_save, "zero3", str(source), str(tmp_path / "zero3")):
        assert all(torch.equal(state[k], saved[k]) for k in saved)
    _assert_same_files(tmp_path / "zero3", source)
    state = _load_and_save("replicate", str(source), str(tmp_path / "replicate"))
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    _assert_same_files(tmp_path / "replicate", source)


@pytest.mark.slow
def test_a_checkpoint_of_four_ranks_loads_exactly_into_hybrid(launches: dict) -> None:
    base = launches[4]["path"]
    got = launches[4]["checkpoints"]
    assert all(torch.equal(got["zero2_as_hybrid"][k], got["zero2"][k]) for k in got["zero2"])
    _assert_same_files(Path(f"{base}.zero2-as-hybrid.ckpt"), Path(f"{base}.zero2.ckpt"))
