"""A configuration whose workers fail comes back as a RunFailure carrying their error."""

from __future__ import annotations

import pytest

from dspark.bench.result import BenchConfig
from dspark.bench.runner import RunFailure, run_in_workers

pytestmark = pytest.mark.slow


def test_failing_workers_give_their_stderr_tail() -> None:
    outcome = run_in_workers(BenchConfig(workload="no-such-model", num_devices=1))
    assert isinstance(outcome, RunFailure)
    assert outcome.exit_code != 0
    assert "unknown workload 'no-such-model'" in outcome.stderr_tail
    assert "USDT" not in outcome.stderr_tail
