"""A save or load whose collective times out names the call, the checkpoint's path, the engine step
(and the step a loaded checkpoint holds), the ranks that arrived where known, and the fix; a rank
whose DCP collective timed out raises at once, on every rank, instead of waiting out the timeout
again in the agreement that follows (see [Note: a checkpoint's timeout names the checkpoint])."""

from __future__ import annotations

import time
from pathlib import Path
from unittest import mock

import pytest

from dspark.checkpoint import CheckpointSaveError
from dspark.checkpoint.timeouts import checkpoint_timeout, is_timeout, naming_the_checkpoint
from dspark.errors import CollectiveTimeoutError
from tests.checkpoint.ranks import make_engine, train
from tests.messages import assert_names

GLOO_TIMEOUT = "[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to complete"


def test_the_message_names_the_call_path_step_and_ranks(tmp_path: Path) -> None:
    comm_timeout = CollectiveTimeoutError("rank 0: all_gather of 32 bytes (dspark.save.step_check) timed out "
                                          "after 3 s: rank(s) 1 never joined it", missing_ranks=(1,))
    error = checkpoint_timeout(comm_timeout, call="save", path=tmp_path / "ckpt", step_count=7, rank=0,
                               num_ranks=3)
    assert error.missing_ranks == (1,)
    assert_names(str(error), "rank 0: engine.save(", repr(str(tmp_path / "ckpt")), "engine step 7",
                 "dspark.save.step_check", "after 3 s", "[0, 2] arrived", "[1] did not",
                 "dspark.init(timeout=SECONDS)")
    assert "rank 0: all_gather" not in str(error)   # the rank is named once, up front
    loaded = checkpoint_timeout(RuntimeError(GLOO_TIMEOUT), call="load", path="ckpt", step_count=3, rank=1,
                                num_ranks=2, saved_step=200)
    assert loaded.missing_ranks is None
    assert_names(str(loaded), "rank 1: engine.load(", "a checkpoint of step 200", "engine step 3",
                 "Timed out waiting 3000ms", "not known", "read its shards", "dspark.init(timeout=SECONDS)")


def test_only_timeouts_are_renamed() -> None:
    assert is_timeout(RuntimeError(GLOO_TIMEOUT)) and is_timeout(CollectiveTimeoutError("x"))
    assert not is_timeout(ValueError("timed out")) and not is_timeout(RuntimeError("out of memory"))
    other = CheckpointSaveError("saving failed on rank(s) [1]: RuntimeError: Timed out", failed_ranks=(1,))
    with pytest.raises(CheckpointSaveError) as kept, naming_the_checkpoint("save", "ckpt", step_count=1, rank=0,
                                                                            num_ranks=2):
        raise other
    assert kept.value is other


def _dcp_times_out(path: str, call: str) -> tuple[str, str, float]:
    """This rank's DCP collective times out (gloo's words), inside engine.save or engine.load."""
    engine = make_engine("mlp", "zero2")
    train(engine, "mlp", range(2))
    if call == "load":
        engine.save(path)

    def late(*args: object, **kwargs: object) -> None:
        raise RuntimeError(GLOO_TIMEOUT)

    started = time.monotonic()
    try:
        with mock.patch(f"dspark.checkpoint.storage.{'write' if call == 'save' else 'read'}_state", late):
            getattr(engine, call)(path)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    finally:
        engine.close()
    return "no error", "", 0.0


@pytest.mark.parametrize("call", ["save", "load"])
def test_a_dcp_timeout_names_the_checkpoint_on_every_rank_at_once(pool, tmp_path: Path, call: str) -> None:
    path = tmp_path / "ckpt"
    for kind, message, after_s in pool.run(_dcp_times_out, str(path), call):
        assert kind == "CollectiveTimeoutError", message
        assert_names(message, f"engine.{call}(", repr(str(path)), "engine step 2", "Timed out waiting 3000ms")
        # no agreement that would wait out the pool's 60 s timeout on a group that is out of step
        assert after_s < 30, after_s
    if call == "save":
        assert not path.exists() and not list(tmp_path.glob(".ckpt.tmp-*"))   # nothing published or left
