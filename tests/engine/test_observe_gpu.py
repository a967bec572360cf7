"""The step breakdown and traces on CUDA (marked ``gpu``, skipped where CUDA is absent): CUDA events on
the current stream, read only when step_stats() is asked; NVTX ranges while tracing."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import dspark
from dspark.engine import STEP_STATS_KEYS

pytestmark = pytest.mark.gpu


def _engine(**kwargs: object) -> dspark.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    return dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), **kwargs)


def _step(engine: dspark.Engine) -> None:
    x = torch.randn(256, 512, device="cuda")
    engine.backward(engine(x).square().mean())
    engine.step()


def test_cuda_events_are_read_only_when_asked(single_process, monkeypatch: pytest.MonkeyPatch) -> None:
    assert single_process.device.type == "cuda"
    engine = _engine(strategy="zero2", precision="bf16")
    reads = [0]
    original = torch.cuda.Event.synchronize

    def counted(event: torch.cuda.Event) -> None:
        reads[0] += 1
        original(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    _step(engine)
    torch.cuda.synchronize()
    time.sleep(0.05)  # the stream idles while the host "loads data"
    for _ in range(3):
        _step(engine)
    assert reads[0] == 0  # training added no synchronisation
    stats = engine.step_stats()
    assert reads[0] > 0
    assert tuple(stats) == STEP_STATS_KEYS
    assert stats["forward_ms"] > 0 and stats["backward_ms"] > 0 and stats["optimizer_ms"] > 0
    phases = stats["forward_ms"] + stats["backward_ms"] + stats["optimizer_ms"] + stats["comm_exposed_ms"]
    assert phases <= stats["step_ms"] + 1e-3
    assert stats["comm_exposed_ms"] == 0.0  # one process: nothing to wait for
    engine.close()


def test_data_ms_is_stream_time_between_steps(single_process) -> None:
    engine = _engine()
    _step(engine)
    _step(engine)
    torch.cuda.synchronize()
    time.sleep(0.05)
    _step(engine)
    assert engine.step_stats()["data_ms"] >= 45.0
    engine.close()


def test_cuda_trace_has_the_phases_and_nvtx_ranges(single_process, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pushed: list[str] = []
    original = torch.cuda.nvtx.range_push

    def counted(name: str) -> object:
        pushed.append(name)
        return original(name)

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", counted)
    engine = _engine(trace_dir=tmp_path, trace_steps=(1, 1))
    for _ in range(3):
        _step(engine)
    engine.close()
    assert {"dspark.forward", "dspark.backward", "dspark.optimizer"} <= set(pushed)
    trace = json.loads((tmp_path / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "dspark.forward" in names
