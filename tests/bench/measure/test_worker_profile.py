"""The worker's step breakdown on the 2-rank pool: a rank slowed on purpose (a sleep in its forward,
through the worker's test-only environment variable) is flagged as the straggler, by rank and host,
while the step times of both ranks stay alike. The healthy case runs in the end-to-end seed suite
(tests/bench/test_cli_bench.py), whose ranks are pinned to their cores."""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
from typing import Any

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.ledger.measurement import Measurement, results_from_measurements
from dspark.bench.measure.worker import SLOW_RANK_ENV, run_config
from dspark.bench.result import BenchConfig
from tests.messages import assert_names

# Ten times a 1-sample gpt2-cpu step's compute here (36 ms), and a third of it where CI's box was
# loaded enough to stretch that compute to 1.2 s: a 100 ms sleep then hid in the noise (76 ms measured).
SLEEP_MS = 400.0
# fp32: on a CPU without native bf16 (AVX2 only) the preset's bf16 step computes 2.3 s, and the
# sleep is then 15% of it, below the straggler rule's line.
CONFIG = BenchConfig(workload="gpt2-cpu", num_devices=2, global_batch=2, warmup_steps=1,
                     measure_steps=4, precision="fp32")


def _measure_with_rank_1_slowed() -> dict[str, Any]:
    os.environ[SLOW_RANK_ENV] = f"1:{SLEEP_MS:g}"
    try:
        return run_config(CONFIG, probe=False, profile=True).to_dict()
    finally:
        del os.environ[SLOW_RANK_ENV]


@pytest.mark.serial
def test_a_rank_slowed_on_purpose_is_flagged_as_the_straggler(pool) -> None:
    first, _ = pool.run(_measure_with_rank_1_slowed)
    m = dataclasses.replace(Measurement.from_dict(first), run_id="slowed")
    assert m.profiled and m.hosts_by_rank == [socket.gethostname()] * 2
    assert m.optimizer_kernel == "fused"  # DSpark's engine chose PyTorch's fused AdamW
    compute = [statistics.median(phases["compute_ms"]) for phases in m.phase_ms_by_rank]
    assert compute[1] - compute[0] > 0.6 * SLEEP_MS  # the sleep is rank 1's compute ...
    waits = [statistics.median(phases["comm_exposed_ms"]) for phases in m.phase_ms_by_rank]
    assert waits[0] > waits[1]  # ... and rank 0's wait for it

    [result] = annotate(results_from_measurements([m]))
    [found] = [a for a in result.anomalies if a["kind"] == "straggler"]
    assert found["rank"] == 1 and found["host"] == socket.gethostname()
    assert found["message"].startswith(f"rank 1 on host {socket.gethostname()} computes ")
    assert found["compute_ms"] == pytest.approx(result.phase_ms_by_rank[1]["compute_ms"])


def test_a_bad_slow_rank_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from dspark.bench.measure.worker import _slow_down

    monkeypatch.setenv(SLOW_RANK_ENV, "rank one")
    with pytest.raises(ValueError) as caught:
        _slow_down(nn.Linear(2, 2), 0)
    assert_names(str(caught.value), "DSPARK_BENCH_SLOW_RANK='rank one'", "RANK:MS")
