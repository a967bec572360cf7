"""A configuration whose workers fail comes back as a RunFailure carrying their error."""

from __future__ import annotations

import platform

import pytest

from dspark.bench.ledger.measurement import Measurement
from dspark.bench.measure.runner import RunFailure, run_in_workers
from dspark.bench.result import BenchConfig
from tests.messages import assert_line_names

pytestmark = pytest.mark.slow


def test_failing_workers_give_their_stderr_tail() -> None:
    outcome = run_in_workers(BenchConfig(workload="no-such-model", num_devices=1))
    assert isinstance(outcome, RunFailure)
    assert outcome.exit_code != 0
    assert_line_names(outcome.stderr_tail, "workload", "'no-such-model'")
    assert "USDT" not in outcome.stderr_tail


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc on Linux only")
def test_pytorch_peers_keep_glibc_malloc_and_dspark_sets_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP runs as its users run it; DSpark's engine with dspark.init()'s malloc thresholds; and
    DSPARK_CPU_MALLOC set by the caller reaches the peer too."""
    monkeypatch.delenv("DSPARK_CPU_MALLOC", raising=False)

    def malloc_of(strategy: str) -> str:
        outcome = run_in_workers(BenchConfig(workload="gpt2-cpu", num_devices=1, strategy=strategy,
                                             precision="fp32", global_batch=2, warmup_steps=0,
                                             measure_steps=1), probe=False)
        assert isinstance(outcome, Measurement), outcome
        return outcome.cpu_malloc

    assert malloc_of("torch-ddp") == "default (DSPARK_CPU_MALLOC=default)"
    assert malloc_of("replicate") == "dspark"
    monkeypatch.setenv("DSPARK_CPU_MALLOC", "tuned")
    assert malloc_of("torch-ddp") == "dspark"
