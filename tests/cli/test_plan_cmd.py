"""``dspark plan``: the table, --json, --plot, --probe reuse, and bad input as exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.cli.main import main
from dspark.cli.plan_cmd import parse_bytes


def test_plan_prints_writes_json_and_plot_and_replans_from_the_probe(tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--model", "tests.planner.factories:small_mlp", "--devices", "1,2",
                 "--json", str(out), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "replicate" in text and "zero3" in text and "peak MB" in text
    assert "probing tests.planner.factories:small_mlp" in captured.err and "probed in" in captured.err
    assert "probing" not in text  # progress on stderr: stdout is the table alone
    data = json.loads(out.read_text())
    assert {(r["strategy"], r["devices"]) for r in data["rows"]} >= {("zero2", 2), ("replicate", 1)}
    assert png.read_bytes()[:4] == b"\x89PNG"
    again = tmp_path / "again.json"
    assert main(["plan", "--model", "tests.planner.factories:small_mlp", "--devices", "1,2,8",
                 "--probe", str(out), "--interconnect", "nvlink", "--strategies", "zero3",
                 "--json", str(again)]) == 0
    replanned = json.loads(again.read_text())
    assert replanned["probe"] == data["probe"] and replanned["interconnect"] == "nvlink"
    assert {r["devices"] for r in replanned["rows"]} == {1, 2, 8}
    capsys.readouterr()
    assert main(["plan", "--model", "tests.planner.factories:small_mlp", "--devices", "16", "--probe", str(out),
                 "--interconnect", "nvlink+roce-200g", "--strategies", "hybrid-zero3",
                 "--shard-group-size", "4", "--global-batch", "16"]) == 0
    assert "hybrid-zero3 (4x4)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, word", [
    (["--model", "tests.planner.factories:not_a_pair"], "(model, sample_batch)"),
    (["--model", "nomodule"], "module:factory"),
    (["--workload", "gpt2-cpu", "--devices", "0"], "--devices"),
    (["--workload", "gpt2-cpu", "--memory-budget", "lots"], "lots"),
    (["--workload", "gpt2-cpu", "--interconnect", "pcie+roce-200g"], "no node size"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv: list[str], word: str, capsys) -> None:
    assert main(["plan", *argv]) == 2
    assert word in capsys.readouterr().err


def test_parse_bytes() -> None:
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("1.5GiB") == 1610612736
    assert parse_bytes("1e9") == 10**9


def test_trace_fake_plans_memory_without_running_a_step(capsys) -> None:
    assert main(["plan", "--model", "tests.planner.factories:small_mlp", "--devices", "1,2", "--trace", "fake"]) == 0
    assert "fake trace" in capsys.readouterr().out


_FACTORY = """
import torch
from torch import nn
import torch.nn.functional as F

def build():
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    return model, (torch.randn(32, 8), torch.randint(0, 4, (32,))), F.cross_entropy
"""


@pytest.mark.parametrize("spec", ["mymodels:build", "sub/mymodels.py:build"])
def test_the_users_factory_is_found_from_their_directory(tmp_path: Path, spec: str) -> None:
    # the installed `dspark` command, as a user runs it: a console script, whose sys.path lacks
    # the current directory (python -m would add it, and hide the bug)
    (tmp_path / "sub").mkdir()
    (tmp_path / "mymodels.py").write_text(_FACTORY)
    (tmp_path / "sub" / "mymodels.py").write_text(_FACTORY)
    dspark_cmd = Path(sys.executable).parent / "dspark"
    done = subprocess.run([str(dspark_cmd), "plan", "--model", spec, "--devices", "1,2", "--trace", "fake"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "zero3" in done.stdout and "peak MB" in done.stdout
