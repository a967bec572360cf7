"""Ranks agree on failures before any collective that a failed rank would never reach.

A constructor step that fails on one rank only (an optimizer factory that raises, a model that cannot
be materialised) would leave the other ranks waiting in the next collective until the timeout. Each
such step is followed by one :func:`agree`: if any rank failed, every rank raises, the failed ranks
their own exception, the others an :class:`~dspark.errors.OtherRankError` that names the ranks and
the first error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dspark import comm
from dspark.errors import OtherRankError

__all__ = ["agree", "agreed"]

T = TypeVar("T")


def agree(failure: BaseException | None, *, what: str) -> None:
    """Collective: raise on every rank if ``failure`` is not None on any rank.

    Example::

        try:
            optimizer = factory(groups)
        except Exception as exc:
            agree(exc, what="building the optimizer")
            raise
        agree(None, what="building the optimizer")
    """
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports = comm.all_gather_object(mine, label="dspark.agree")
    failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
    if not failed:
        return
    if failure is not None:
        raise failure
    rank = comm.get_world().rank
    ranks = [r for r, _ in failed]
    raise OtherRankError(f"rank {rank}: {what} failed on rank(s) {ranks}: {failed[0][1][:500]}",
                         failed_ranks=tuple(ranks))


def agreed(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on this rank, then :func:`agree` with every rank that it succeeded everywhere.

    Example::

        optimizer = agreed("building the optimizer", lambda: factory(groups))
    """
    try:
        out = fn()
    except Exception as exc:
        agree(exc, what=what)
        raise
    agree(None, what=what)
    return out
