"""The words of a collective that did not complete: one message for a timeout whichever transport
carried the collective (gloo, NCCL or DSpark's shared memory), and the refusal of every collective
of a group after one of its collectives timed out.

[Note: a timed-out group stays failed] A collective that timed out leaves the ranks out of step: the
late rank, when it arrives, pairs its collectives with the wrong ones (or none). So the first
timeout of a group is the group's last word: every later collective on it, and every wait on one
already launched, raises at once with that first timeout in its message. Without this, cleanup that
lets launched collectives land before their buffers are reused (a failed backward's buckets) waited
out the timeout a second time, and the error surfaced after twice the stated time.
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark.comm.observer import current_observer
from dspark.errors import CollectiveTimeoutError

__all__ = ["describe", "group_failed_error", "timeout_error"]


def describe(kind: str, nbytes: int, label: str | None, *more: str) -> str:
    """``all_reduce of 22360 bytes (dspark.bucket0.all_reduce)``: a collective as messages name it.

    Example::

        describe("all_reduce", 16, None, "collective #1")   # 'all_reduce of 16 bytes (collective #1)'
    """
    notes = [n for n in (label, *more) if n]
    return f"{kind} of {nbytes} bytes" + (f" ({', '.join(notes)})" if notes else "")


def _where() -> str:
    """Where the caller is (``" in engine step 3, backward"``) when an observer knows, else ``""``."""
    observer = current_observer()
    where = observer.where() if observer is not None else None
    return f" in {where}" if where else ""


def timeout_error(*, rank: int, what: str, timeout_s: float, missing: Sequence[int] | None,
                  others: Sequence[int], detail: str = "") -> CollectiveTimeoutError:
    """The error of a collective (``what``, from :func:`describe`) that ``rank`` waited on for
    ``timeout_s``: ``missing`` are the ranks that never joined where the transport knows them,
    else one of ``others`` is (the backend does not say which).

    Example::

        raise timeout_error(rank=0, what=describe("all_reduce", 16, "dspark.agree"), timeout_s=5.0,
                            missing=[1], others=[1])
    """
    if missing is not None:
        who = f"rank(s) {', '.join(map(str, missing))}"
    elif len(others) == 1:
        who = f"rank(s) {others[0]}"
    else:
        who = f"one or more of rank(s) {', '.join(map(str, others))} (the backend does not say which)"
    return CollectiveTimeoutError(
        f"rank {rank}: {what}{_where()} timed out after {timeout_s:g} s{detail}: {who} never joined "
        f"it (skipped it, is busy or stuck elsewhere, crashed, or called a different collective). "
        f"A rank that legitimately works longer between collectives (an evaluation or a save on one "
        f"rank alone) needs a longer dspark.init(timeout=SECONDS)",
        missing_ranks=None if missing is None else tuple(missing))


def group_failed_error(*, rank: int, what: str, first: CollectiveTimeoutError) -> CollectiveTimeoutError:
    """The refusal of a collective (``what``) on a group whose collective ``first`` timed out (see
    [Note: a timed-out group stays failed]): a timeout too, naming the first one.

    Example::

        raise group_failed_error(rank=0, what=describe("all_gather", 64, "dspark.gather.0"), first=exc)
    """
    return CollectiveTimeoutError(
        f"rank {rank}: {what}{_where()} not run: the group stopped at an earlier timeout (the ranks "
        f"are out of step; end the job, or let `dspark run --max-restarts N` restart it from the "
        f"last checkpoint): {first}", missing_ranks=first.missing_ranks)
