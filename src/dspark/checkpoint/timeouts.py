"""A save or load that timed out names its checkpoint: the call, the path, the engine step, the ranks
that arrived and the fix.

[Note: a checkpoint's timeout names the checkpoint] A collective of a save or load that a rank never
joins (a rank that skipped ``engine.save``, one still busy elsewhere, one stalled writing its shards)
times out in the comm layer, whose message knows the collective (``all_gather of 32 bytes``) but not
that it was part of ``engine.save('ckpt/step-200')`` at step 200; DCP's own collectives time out in
the backend (gloo: ``Timed out waiting ...``) with less still. :func:`naming_the_checkpoint`
wraps a whole save or load (its step check included) and re-raises either as a
:class:`~dspark.errors.CollectiveTimeoutError` that says so, keeping the ranks that never joined
where the transport knows them. A rank whose DCP collective timed out raises at once rather than
agreeing with the others first: its group is out of step (see [Note: a timed-out group stays
failed] in :mod:`dspark.comm.failures`), so the agreement would only wait out the timeout again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from dspark.checkpoint.info import read_checkpoint_info
from dspark.errors import CollectiveTimeoutError

__all__ = ["checkpoint_timeout", "is_timeout", "naming_the_checkpoint"]


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's timeout: DSpark's own, or the backend's words for one (gloo
    raises a plain ``RuntimeError`` "Timed out waiting ...", NCCL a ``DistBackendError``)."""
    if isinstance(exc, TimeoutError):
        return True
    return type(exc).__name__ in ("RuntimeError", "DistBackendError") and "timed out" in str(exc).lower()


def checkpoint_timeout(exc: BaseException, *, call: str, path: str | os.PathLike[str], step_count: int,
                       rank: int, num_ranks: int, saved_step: int | None = None) -> CollectiveTimeoutError:
    """The error of ``engine.<call>(path)`` at engine step ``step_count`` whose collective timed out
    with ``exc`` on ``rank`` of ``num_ranks``; ``saved_step``: the step of the checkpoint a load read,
    where known. Pure: no process group.

    Example::

        checkpoint_timeout(exc, call="save", path="ckpt", step_count=2, rank=0, num_ranks=2)
        # CollectiveTimeoutError: rank 0: engine.save('/abs/ckpt') at engine step 2 did not complete:
        # all_gather ... timed out ...: rank(s) 1 never joined it ...
    """
    missing = exc.missing_ranks if isinstance(exc, CollectiveTimeoutError) else None
    what = str(exc).removeprefix(f"rank {rank}: ")
    of = f" (a checkpoint of step {saved_step})" if saved_step is not None else ""
    if missing is not None:
        arrived = [r for r in range(num_ranks) if r not in missing]
        who = f" Rank(s) {arrived} arrived; rank(s) {list(missing)} did not."
    else:
        who = " Which ranks arrived is not known (the backend does not say)."
    longer = "" if "dspark.init(timeout=" in what else (
        f"; a rank that needs longer to get there or to {'write' if call == 'save' else 'read'} its shards "
        "(a slow disk, a large model) needs a longer dspark.init(timeout=SECONDS)")
    return CollectiveTimeoutError(
        f"rank {rank}: engine.{call}({str(Path(path).absolute())!r}){of} at engine step {step_count} did "
        f"not complete: {what.rstrip('.')}.{who} Every rank must call engine.{call}() at the same step (a "
        f"condition true on some ranks only, or an exception caught on one rank, skips it there){longer}",
        missing_ranks=missing)


@contextlib.contextmanager
def naming_the_checkpoint(call: str, path: str | os.PathLike[str], *, step_count: int, rank: int,
                          num_ranks: int) -> Iterator[None]:
    """Re-raise a timeout inside the block as :func:`checkpoint_timeout` (see [Note: a checkpoint's
    timeout names the checkpoint]); any other error passes unchanged.

    Example::

        with naming_the_checkpoint("save", path, step_count=engine.step_count, rank=0, num_ranks=2):
            save_checkpoint(engine, path)
    """
    try:
        yield
    except Exception as exc:
        if not isinstance(path, (str, os.PathLike)) or not is_timeout(exc):
            raise
        saved_step = _saved_step(path) if call == "load" else None
        raise checkpoint_timeout(exc, call=call, path=path, step_count=step_count, rank=rank,
                                 num_ranks=num_ranks, saved_step=saved_step) from exc


def _saved_step(path: str | os.PathLike[str]) -> int | None:
    """The step of the checkpoint at ``path``, for a message: None when it cannot be read."""
    try:
        return read_checkpoint_info(path).step_count
    except Exception:
        return None
