"""dspark.Tracker writes rank 0's scalars to CSV, JSONL and TensorBoard event files that TensorBoard's
own reader parses; other ranks write nothing; W&B and MLflow get the same values when asked for."""

from __future__ import annotations

import csv
import functools
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dspark
from tests.messages import assert_names


def _log_run(directory: Path) -> None:
    with dspark.Tracker(directory, backends=("csv", "tensorboard")) as tracker:
        tracker.log({"loss": 2.5, "acc": torch.tensor(0.25)}, step=0)
        tracker.log({"loss": torch.tensor([1.5])}, step=1)


def test_csv_jsonl_and_an_event_file_tensorboard_reads(single_process, tmp_path: Path) -> None:
    _log_run(tmp_path)
    with (tmp_path / "scalars.csv").open() as f:
        rows = [(int(r["step"]), r["name"], float(r["value"])) for r in csv.DictReader(f)]
    assert rows == [(0, "loss", 2.5), (0, "acc", 0.25), (1, "loss", 1.5)]
    lines = [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    assert [(line["step"], line.get("loss"), line.get("acc")) for line in lines] == [(0, 2.5, 0.25), (1, 1.5, None)]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["acc", "loss"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 2.5), (1, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("acc")] == [(0, 0.25)]


def _tracker_on_ranks(directory: str) -> list[str]:
    rank = dspark.get_world().rank
    _log_run(Path(directory))
    return sorted(p.name for p in Path(directory).iterdir()) if rank == 0 else []


def test_only_rank_0_writes(pool, tmp_path: Path) -> None:
    files, other = pool.run(_tracker_on_ranks, str(tmp_path))
    assert other == [] and "scalars.csv" in files and any(f.startswith("events.out.tfevents") for f in files)
    assert len([f for f in files if f.startswith("events.out.tfevents")]) == 1  # one writer, not one per rank
    with (tmp_path / "scalars.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 3


class _FakeEngine:
    def step_stats(self) -> dict[str, float]:
        return {"step_ms": 41.5, "forward_ms": 12.0}


def test_step_stats_become_scalars(single_process, tmp_path: Path) -> None:
    with dspark.Tracker(tmp_path, backends=()) as tracker:
        tracker.log_step_stats(_FakeEngine(), step=3)
    line = json.loads((tmp_path / "scalars.jsonl").read_text())
    assert line["step"] == 3 and line["step/step_ms"] == 41.5 and line["step/forward_ms"] == 12.0


def test_wandb_and_mlflow_get_the_values(single_process, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    run = types.SimpleNamespace(log=lambda v, step: calls.append(("wandb.log", (v, step))),
                                finish=lambda: calls.append(("wandb.finish", None)))
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: calls.append(("wandb.init", kw["project"])) or run  # type: ignore[attr-defined]
    mlflow = types.ModuleType("mlflow")
    mlflow.set_experiment = lambda name: calls.append(("mlflow.experiment", name))  # type: ignore[attr-defined]
    mlflow.start_run = lambda run_name: calls.append(("mlflow.start", run_name))  # type: ignore[attr-defined]
    mlflow.log_params = lambda p: calls.append(("mlflow.params", p))  # type: ignore[attr-defined]
    mlflow.log_metrics = lambda v, step: calls.append(("mlflow.log", (v, step)))  # type: ignore[attr-defined]
    mlflow.end_run = lambda: calls.append(("mlflow.end", None))  # type: ignore[attr-defined]
    for module in (wandb, mlflow):
        module.__spec__ = types.SimpleNamespace(name=module.__name__)  # type: ignore[assignment]
        monkeypatch.setitem(sys.modules, module.__name__, module)
    with dspark.Tracker(tmp_path, backends=("wandb", "mlflow"), project="p", run_name="r",
                        config={"lr": 0.1}) as tracker:
        tracker.log({"loss": 2.0}, step=7)
    assert calls == [("wandb.init", "p"), ("mlflow.experiment", "p"), ("mlflow.start", "r"),
                     ("mlflow.params", {"lr": 0.1}), ("wandb.log", ({"loss": 2.0}, 7)),
                     ("mlflow.log", ({"loss": 2.0}, 7)), ("wandb.finish", None), ("mlflow.end", None)]


def test_wrong_input_is_named(single_process, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        dspark.Tracker(tmp_path, backends=("tb",))
    assert_names(str(caught.value), "'tb'", "tensorboard")
    with pytest.raises(TypeError, match=r"backends='csv': pass a tuple"):
        dspark.Tracker(tmp_path, backends="csv")
    with dspark.Tracker(tmp_path, backends=()) as tracker:
        with pytest.raises(TypeError) as caught:
            tracker.log({"pred": torch.zeros(2)}, step=0)
        assert_names(str(caught.value), "'pred'", "(2,)")
        with pytest.raises(ValueError) as caught:
            tracker.log({"loss": 1.0}, step=-1)
        assert_names(str(caught.value), "step=-1", ">= 0")
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log({"loss": 1.0}, step=0)


def test_a_backend_whose_package_is_missing_names_the_install(single_process, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib then finds no wandb
    with pytest.raises(ModuleNotFoundError) as caught:
        dspark.Tracker(tmp_path, backends=("wandb",))
    assert_names(str(caught.value), "'wandb'", "pip install wandb")
    assert not (tmp_path / "scalars.csv").exists()  # refused before anything is written


def test_a_real_engines_step_breakdown_is_logged(single_process, tmp_path: Path) -> None:
    engine = dspark.Engine(torch.nn.Linear(4, 1), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    with dspark.Tracker(tmp_path, backends=()) as tracker:
        tracker.log_step_stats(engine, step=1)
    line = json.loads((tmp_path / "scalars.jsonl").read_text())
    assert {f"step/{k}" for k in engine.step_stats()} <= set(line) and line["step/step_ms"] > 0
    engine.close()
