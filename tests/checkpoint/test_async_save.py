"""``engine.save(path, async_save=True)``: returns once the state is copied, writes it while training
goes on, publishes it atomically; the next save, a load and shutdown wait for it; a failure is
raised on every rank; a crash while it writes leaves the previous checkpoint loadable."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp

import dspark
from dspark.checkpoint import (
    CheckpointSaveError,
    is_checkpoint,
    pending_save_path,
    read_checkpoint_info,
    wait_for_pending_save,
)
from tests.checkpoint.ranks import (
    SAVED_LR,
    SAVED_STEPS,
    load_then_continue,
    make_engine,
    save_then_continue,
    train,
)
from tests.messages import assert_names

_DISK_FULL = "No space left on device (simulated)"
"""The error the simulated disk raises (the engine relays it whole)."""

SCRIPT = Path(__file__).parent / "scripts" / "crash_during_async_save.py"


@contextmanager
def _slow_writes(delay_s: float = 0.5) -> Iterator[None]:
    real = dcp.FileSystemWriter.write_data

    def slow(self: Any, plan: Any, planner: Any) -> Any:
        time.sleep(delay_s)
        return real(self, plan, planner)

    with mock.patch.object(dcp.FileSystemWriter, "write_data", slow):
        yield


def _slowly_save_then_continue(path: str) -> dict[str, Any]:
    with _slow_writes():
        return save_then_continue(path, "mlp", "zero3", async_save=True)


def test_an_async_save_holds_the_state_of_its_step(pool, tmp_path: Path) -> None:
    # the save returns at once and the next step changes every tensor before the (slowed) write
    # starts: the loaded checkpoint must still be the state at the save's step
    path = str(tmp_path / "ckpt")
    want = pool.run(_slowly_save_then_continue, path)
    got = pool.run(load_then_continue, path, "mlp", "zero2")
    for rank in range(2):
        assert got[rank]["step_count"] == SAVED_STEPS and got[rank]["lr"] == SAVED_LR
        for key, value in want[rank]["state"].items():
            assert value.equal(got[rank]["state"][key]), key


def _async_then(path: str, then: str) -> dict[str, Any]:
    """Save at ``path`` in the background (slowly), check it is in flight, then do ``then``."""
    engine = make_engine("mlp", "zero2")
    train(engine, "mlp", range(1))
    out: dict[str, Any] = {}
    with _slow_writes():
        engine.save(path, async_save=True)
        out["in_flight"] = pending_save_path() == Path(path).absolute() and not is_checkpoint(path)
        train(engine, "mlp", range(1, 2))  # training goes on meanwhile
        if then == "save":
            engine.save(path + "-next")
        elif then == "load":
            out["loaded_step"] = engine.load(path).step_count
        out["published"] = is_checkpoint(path)
    out["pending_after"] = pending_save_path()
    engine.close()
    return out


def test_the_next_save_and_a_load_wait_for_the_save_in_flight(pool, tmp_path: Path) -> None:
    for then in ("save", "load"):
        path = str(tmp_path / then)
        for rank in pool.run(_async_then, path, then):
            assert rank["in_flight"] and rank["published"] and rank["pending_after"] is None
            assert rank.get("loaded_step", 1) == 1
        assert read_checkpoint_info(path).step_count == 1
    assert read_checkpoint_info(tmp_path / "save-next").step_count == 2


def _async_failure(path: str, failing_rank: int) -> str:
    engine = make_engine("mlp", "zero2")
    train(engine, "mlp", range(2))
    engine.save(path)  # the previous checkpoint, at step 2
    train(engine, "mlp", range(2, 3))

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        raise OSError(28, _DISK_FULL)

    with ExitStack() as stack:
        if dspark.get_world().rank == failing_rank:
            stack.enter_context(mock.patch.object(dcp.FileSystemWriter, "write_data", disk_full))
        engine.save(path, async_save=True)  # returns: the failure happens in the background
        train(engine, "mlp", range(3, 4))
        try:
            wait_for_pending_save()
        except CheckpointSaveError as exc:
            return str(exc)
        finally:
            engine.close()
    raise AssertionError("the background save did not fail")


def test_a_failed_background_save_fails_every_rank_and_keeps_the_old_checkpoint(pool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    for message in pool.run(_async_failure, str(path), 1):
        assert_names(message, "failed on rank(s) [1]", _DISK_FULL)
    assert read_checkpoint_info(path).step_count == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_shutdown_waits_for_the_save_in_flight(single_process, tmp_path: Path) -> None:
    engine = make_engine("tied", "replicate")
    train(engine, "tied", range(1))
    with _slow_writes():
        engine.save(tmp_path / "ckpt", async_save=True)
        assert not is_checkpoint(tmp_path / "ckpt")
        engine.close()
        dspark.shutdown()
    assert read_checkpoint_info(tmp_path / "ckpt").step_count == 1


def test_a_crash_during_the_background_write_leaves_the_previous_checkpoint(
        single_process, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), str(tmp_path / "writing")],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == -9, done.stderr[-3000:]
    assert (tmp_path / "writing").exists()  # it died while the new shard file was on disk
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.tmp-")]
    assert len(leftovers) == 1
    assert read_checkpoint_info(path).step_count == 1
    engine = dspark.Engine(torch.nn.Linear(4, 3), optimizer=lambda p: torch.optim.AdamW(p, lr=0.1))
    assert engine.load(path).step_count == 1 and engine.step_count == 1
    engine.save(path)  # the dead save's staging directory is cleared by the next one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "writing"]
