"""A process baseline pinned for tests of auto's choice: the choice between strategies whose
tensor peaks differ by a few hundred kilobytes must not depend on how much resident memory a pool
rank happens to hold (see [Note: process memory]), nor on the high water auto's own probes reach
in it ([Note: auto's own probes and the budget]), nor on how large a batch its probe may train
([Note: the probe inside the budget]); these are tested apart (tests/planner/test_auto_budget.py,
tests/planner/test_probe_budget.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

BASELINE_BYTES = 300 << 20
"""What the pinned rank's process holds besides its tensors."""


@contextlib.contextmanager
def pinned_baseline(nbytes: int = BASELINE_BYTES) -> Iterator[None]:
    """Inside: ``strategy="auto"`` reads ``nbytes`` as this rank's process baseline, its probes set
    no new high water, and their size is not predicted (the probe trains the whole batch)."""
    with (mock.patch("dspark.planner.auto_choice.this_process_baseline_bytes", return_value=nbytes),
          mock.patch("dspark.planner.auto_choice.high_water_bytes", return_value=nbytes),
          mock.patch("dspark.planner.auto_choice.probe_need", return_value=None)):
        yield
