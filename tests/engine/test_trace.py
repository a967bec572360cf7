"""Engine(trace_dir=...): one Chrome/Perfetto trace per rank naming DSpark's phases and collectives;
with tracing off, not a single profiler range is opened."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
from dspark.engine import named_ranges
from tests.engine import tiny_models as tm
from tests.messages import assert_line_names, assert_names


def _train(name: str, strategy: str, steps: int, **engine_kwargs: Any) -> None:
    engine = dspark.Engine(tm.make(name), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy, bucket_mb=1e-4, **engine_kwargs)
    for step in range(steps):
        x, y = dspark.distribute_batch(tm.batch(name, 8, step), shard_dim=0)
        engine.backward(tm.loss_fn(name, engine(x), y))
        engine.step()
    engine.close()


def _names(path: Path) -> set[str]:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {str(e.get("name")) for e in events}


@pytest.mark.parametrize("strategy,collective", [("replicate", "dspark.bucket0.all_reduce"),
                                                 ("zero3", "dspark.gather.blocks.0")])
def test_every_rank_writes_a_trace_naming_phases_and_collectives(pool, tmp_path: Path, strategy: str,
                                                                 collective: str) -> None:
    pool.run(_train, "tied", strategy, 4, trace_dir=str(tmp_path), trace_steps=(1, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json"]
    for path in tmp_path.iterdir():
        names = _names(path)
        for phase in ("dspark.forward", "dspark.backward", "dspark.optimizer", "dspark.comm.wait",
                      "dspark.step_extras.all_reduce", collective):
            assert phase in names, (path.name, phase, sorted(n for n in names if "dspark" in n))
        # the traced steps only: the profiler's step markers of the 2 active steps
        assert len([n for n in names if n.startswith("ProfilerStep#")]) == 2


def _count_profiler_ranges(name: str, strategy: str, ranges_on: bool) -> int:
    calls = [0]
    original = torch.profiler.record_function

    class Counting(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls[0] += 1
            super().__init__(*args, **kwargs)

    torch.profiler.record_function = Counting
    try:
        if ranges_on:
            with named_ranges():
                _train(name, strategy, 2)
        else:
            _train(name, strategy, 2)
    finally:
        torch.profiler.record_function = original
    return calls[0]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_no_profiler_call_when_tracing_is_off(pool, strategy: str) -> None:
    assert pool.run(_count_profiler_ranges, "tied", strategy, False) == [0, 0]
    # the same run with ranges on opens many: the count above could see them
    assert min(pool.run(_count_profiler_ranges, "tied", strategy, True)) > 10


@pytest.mark.parametrize("trace_steps", [(1,), (-1, 2), (1, 0), [1, 2], (1.0, 2)])
def test_trace_steps_are_checked(single_process, tmp_path: Path, trace_steps: Any) -> None:
    with pytest.raises(ValueError, match="trace_steps"):
        dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                      trace_dir=tmp_path, trace_steps=trace_steps)


def test_trace_dir_must_be_a_path(single_process) -> None:
    with pytest.raises(TypeError, match="trace_dir=3"):
        dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.SGD, lr=0.1), trace_dir=3)


def test_trace_dir_inside_the_users_profiler_is_refused_and_the_model_left_alone(single_process,
                                                                                 tmp_path: Path) -> None:
    """One PyTorch profiler per process: the engine's own trace inside the user's would break both.
    Refused before any hook is on the model, which then trains as usual in the user's profiler."""
    model = tm.make("mlp")
    with torch.profiler.profile() as prof:
        with pytest.raises(RuntimeError, match=r"already recording.*named_ranges\(\)"):
            dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                          trace_dir=tmp_path)
        assert not model._forward_pre_hooks and all(not p._post_accumulate_grad_hooks
                                                    for p in model.parameters())
        engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        with named_ranges():
            engine.backward(engine(torch.randn(4, 6)).sum())
            engine.step()
        engine.close()
    assert "dspark.forward" in {e.key for e in prof.key_averages()}
    assert not list(tmp_path.iterdir())


def test_close_before_the_active_steps_end_writes_what_was_recorded(single_process, tmp_path: Path) -> None:
    _train("mlp", "replicate", 2, trace_dir=tmp_path / "nested", trace_steps=(1, 5))
    assert "dspark.forward" in _names(tmp_path / "nested" / "rank0.json")


_SHORT_RUN = """
import functools, torch, dspark
dspark.init()
engine = dspark.Engine(torch.nn.Linear(8, 8), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                       trace_dir={trace_dir!r}, trace_steps=(1, 5))
for step in range(3):
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    engine.step()
{ending}
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["dspark.shutdown()", ""])
def test_a_run_shorter_than_the_trace_exits_cleanly_with_what_was_traced(tmp_path: Path, ending: str) -> None:
    """Training that ends before ``trace_steps`` are done, without ``engine.close()``: at
    ``dspark.shutdown()`` or the interpreter's exit the still-running profiler crashed the process
    (SIGSEGV); now the session is closed there, its steps written, and a warning says how many."""
    import subprocess
    import sys

    code = _SHORT_RUN.format(trace_dir=str(tmp_path / "t"), ending=ending)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_line_names(done.stderr, "stopped", "3 step(s)")
    assert_names(done.stderr, "2 traced step(s)")
    assert "dspark.forward" in _names(tmp_path / "t" / "rank0.json")


def test_the_trace_export_is_not_the_next_steps_data_time(single_process, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing the trace happens inside step(); it used to land in the next step's data_ms."""
    import time

    from dspark.engine.trace import TraceSession

    real_close = TraceSession.close

    def slow_close(self: TraceSession) -> None:
        real_close(self)
        time.sleep(0.3)  # a large trace's export

    monkeypatch.setattr(TraceSession, "close", slow_close)
    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           trace_dir=tmp_path, trace_steps=(0, 1))
    data_ms = []
    for step in range(3):
        x, y = tm.batch("mlp", 8, step)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
        data_ms.append(engine.step_stats()["data_ms"])
    engine.close()
    assert (tmp_path / "rank0.json").exists()
    assert max(data_ms) < 100, data_ms
