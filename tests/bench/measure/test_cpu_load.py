"""Pinning every thread, and the load on a rank's core, measured in child processes (pinning the
test process itself would pin every worker it starts later)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dspark.bench.measure.cpu_load import CpuSnapshot, core_for_rank, window_load

pytestmark = [pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only"), pytest.mark.serial]


def _python(code: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


_THREADS = """
    import json, os, threading, time
    from dspark.bench.measure.cpu_load import pin_all_threads, thread_ids
    core = sorted(os.sched_getaffinity(0))[-1]
    started = threading.Event()
    def idle():
        started.set(); time.sleep(5)
    threading.Thread(target=idle, daemon=True).start()   # like gloo's threads, before pinning
    started.wait()
    def on_core():
        return sum(os.sched_getaffinity(tid) == {core} for tid in thread_ids())
    os.sched_setaffinity(0, {core})
    only_caller = on_core()
    seen, pinned = pin_all_threads(core)
    print(json.dumps({"threads": len(thread_ids()), "only_caller": only_caller, "seen": seen,
                      "pinned": pinned, "after": on_core()}))
"""


def test_every_thread_is_pinned_not_only_the_caller() -> None:
    out = _python(_THREADS)
    assert out["threads"] == 2
    assert out["only_caller"] == 1  # sched_setaffinity(0, ...) left the other thread floating
    assert out["seen"] == out["pinned"] == out["after"] == 2


_HOG = """
    import json, os, subprocess, sys, time
    from dspark.bench.measure.cpu_load import cpu_snapshot, window_load
    core = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {core})
    hog = subprocess.Popen([sys.executable, "-c",
                            "import time\\nend = time.time() + 3\\nwhile time.time() < end: pass"])
    time.sleep(0.5)  # the hog is running, on this core (it inherited the mask)
    before = cpu_snapshot(core)
    time.sleep(1.5)  # the rank waits: its core belongs to the hog
    after = cpu_snapshot(core)
    hog.kill(); hog.wait()
    load = window_load(before, after, rank=0, core=core)
    print(json.dumps({"share": load.foreign_share, "own": load.own_cpu_s}))
"""


def test_another_process_on_the_ranks_core_is_measured() -> None:
    out = _python(_HOG)
    assert out["own"] < 0.1
    assert out["share"] is not None and out["share"] > 0.6  # the hog had most of the window


def test_window_arithmetic_and_missing_counters() -> None:
    before = CpuSnapshot(wall_s=10.0, own_cpu_s=1.0, core_busy_s=50.0, core_steal_s=2.0,
                         machine_busy_s=90.0, machine_steal_s=2.0)
    after = CpuSnapshot(wall_s=12.0, own_cpu_s=2.5, core_busy_s=51.8, core_steal_s=2.1,
                        machine_busy_s=93.0, machine_steal_s=2.1)
    load = window_load(before, after, rank=1, core=3, threads=(5, 5))
    assert load.foreign_cpu_s == pytest.approx(0.3) and load.steal_s == pytest.approx(0.1)
    assert load.foreign_share == pytest.approx(0.2)
    blind = CpuSnapshot(wall_s=10.0, own_cpu_s=1.0, core_busy_s=None, core_steal_s=None,
                        machine_busy_s=None, machine_steal_s=None)
    assert window_load(blind, blind, rank=0, core=None).foreign_share is None


def test_core_for_rank() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert core_for_rank(0, 1) == cores[0]
    assert core_for_rank(len(cores) - 1, len(cores)) == cores[-1]
    assert core_for_rank(0, len(cores) + 1) is None  # more ranks than cores: nobody is pinned
