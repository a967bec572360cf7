"""`dspark bench` end to end: one tiny seed suite through the real CLI, launcher and workers.

The suite (gpt2-cpu, global batch 4, 1 warm-up and 2 timed steps; 1 device, 2 devices with the
batch replicated, 2 sharded) runs once per module, from a directory that is not the repository,
and every test reads what it left: the JSON, the ledger, the printed tables.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dspark.bench.ledger import Ledger
from dspark.bench.provenance import source_commit
from dspark.bench.result import BenchResult
from dspark.cli.main import main

pytestmark = pytest.mark.slow

TINY = ["--workloads", "gpt2-cpu", "--global-batch", "4", "--warmup", "1", "--steps", "2",
        "--no-progress"]

# The keys issue 4 requires of every result object.
REQUIRED_KEYS = {
    "workload", "num_devices", "strategy", "precision", "batch_placement", "global_batch",
    "step_ms", "step_ms_p10", "step_ms_p90", "samples_per_s", "peak_bytes_per_rank",
    "model_state_bytes_per_rank", "speedup", "efficiency", "anomalies", "git_commit", "git_dirty",
    "dspark_version", "torch_version", "python_version", "host", "device_model", "backend",
    "config_hash", "timestamp",
}


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    where = tmp_path_factory.mktemp("elsewhere")
    db, out = where / "ledger.sqlite", where / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "dspark.cli.main", "bench", "--suite", "seed", *TINY,
         "--db", str(db), "--json", str(out)],
        cwd=where, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    rows = json.loads(out.read_text())
    by_run = {(r["num_devices"], r["batch_placement"]): r for r in rows}
    return {"where": where, "db": db, "rows": rows, "by_run": by_run, "stdout": done.stdout}


def test_json_has_every_required_key(seed_run: dict[str, Any]) -> None:
    assert len(seed_run["rows"]) == 3
    for row in seed_run["rows"]:
        assert REQUIRED_KEYS <= row.keys(), REQUIRED_KEYS - row.keys()
        assert row["step_ms_p10"] <= row["step_ms"] <= row["step_ms_p90"]
        assert row["samples_per_s"] == pytest.approx(4 / (row["step_ms"] / 1e3))
        assert row["peak_bytes_per_rank"] > row["model_state_bytes_per_rank"] > 0
        assert row["git_commit"] == source_commit()[0]  # from the package, not the cwd
        assert row["backend"] == "gloo" and row["device_model"]


def test_replicated_batch_is_seen_and_flagged(seed_run: dict[str, Any]) -> None:
    bug = seed_run["by_run"][(2, "replicate")]
    assert bug["local_batch"] == bug["global_batch"] == 4
    assert bug["replicated_inputs"] == ["batch[0]", "batch[1]"]
    assert "replicated_batch" in [a["kind"] for a in bug["anomalies"]]
    fixed = seed_run["by_run"][(2, "shard")]
    assert fixed["local_batch"] == 2 and fixed["replicated_inputs"] == []
    assert "replicated_batch" not in [a["kind"] for a in fixed["anomalies"]]


def test_scaling_and_traffic_figures(seed_run: dict[str, Any]) -> None:
    one, fixed = seed_run["by_run"][(1, "shard")], seed_run["by_run"][(2, "shard")]
    assert one["speedup"] == 1.0 and one["comm_bytes_per_step"] == 0 and one["bus_bytes_per_s"] == 0
    assert fixed["speedup"] == pytest.approx(one["step_ms"] / fixed["step_ms"])
    assert fixed["comm_bytes_per_step"] > 0 and fixed["bus_bytes_per_s"] > 0
    # Replicate strategy: the gradient all-reduce carries at least the whole fp32 gradient.
    assert fixed["comm_bytes_per_step"] >= fixed["model_state_bytes_expected_per_rank"] // 4
    assert one["peak_bytes_per_rank"] > fixed["peak_bytes_per_rank"]


def test_seed_table_and_verdicts_are_printed(seed_run: dict[str, Any]) -> None:
    assert "bug (batch replicated)" in seed_run["stdout"]
    assert "replicated batch: FLAGGED" in seed_run["stdout"]


def test_ledger_rows(seed_run: dict[str, Any]) -> None:
    with Ledger(seed_run["db"]) as ledger:
        stored = ledger.results()
    assert len(stored) == 3 and len({r.run_id for r in stored}) == 1
    assert [r.to_dict() for r in stored] == seed_run["rows"]


def test_list_compare_export_report(seed_run: dict[str, Any], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    db = str(seed_run["db"])
    run_id = seed_run["rows"][0]["run_id"]
    assert main(["bench", "list", "--db", db]) == 0
    assert capsys.readouterr().out.count(run_id) == 3
    assert main(["bench", "compare", run_id, "latest", "--db", db]) == 0
    assert "3 within noise" in capsys.readouterr().out
    assert main(["bench", "--db", db, "export", "--csv", str(tmp_path / "r.csv")]) == 0
    with open(tmp_path / "r.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 3 and REQUIRED_KEYS <= table[0].keys()
    assert main(["bench", "export", "--json", str(tmp_path / "r.json"), "--run", run_id,
                 "--db", db]) == 0
    assert json.loads((tmp_path / "r.json").read_text()) == seed_run["rows"]
    assert main(["bench", "report", "--report", str(tmp_path / "html"), "--db", db]) == 0
    assert "<h2>Anomalies</h2>" in (tmp_path / "html" / "index.html").read_text()


def test_rerun_stale_reruns_exactly_the_stale_configuration(
        seed_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    current, _ = source_commit()
    old = BenchResult.from_dict({**seed_run["by_run"][(1, "shard")], "run_id": "old-run",
                                 "git_commit": "0" * 40, "git_dirty": False})
    db = tmp_path / "ledger.sqlite"
    with Ledger(db) as ledger:
        ledger.append([old])
    out = tmp_path / "rerun.json"
    assert main(["bench", "rerun", "--stale", "--db", str(db), "--json", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "re-running 1 configuration(s)" in printed and "gpt2-cpu, 1 device," in printed
    rerun = [BenchResult.from_dict(r) for r in json.loads(out.read_text())]
    assert [r.key for r in rerun] == [old.key]
    assert (rerun[0].warmup_steps, rerun[0].measure_steps) == (1, 2)
    with Ledger(db) as ledger:
        assert ledger.latest_by_key()[old.key].git_commit == current
        assert len(ledger.results()) == 2


def test_bad_input_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workloads", "nope", "--no-progress"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert main(["bench", "--devices", "1,64"]) == 2
    assert "needs 64 devices" in capsys.readouterr().err


def test_a_failed_configuration_makes_the_exit_code_1(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dspark.bench import runner

    def fail(config: Any) -> runner.RunFailure:
        return runner.RunFailure(config=config, exit_code=1, stderr_tail="rank 0: Traceback ...")

    monkeypatch.setattr(runner, "run_in_workers", fail)
    db = tmp_path / "ledger.sqlite"
    assert main(["bench", *TINY, "--devices", "1", "--db", str(db)]) == 1
    assert "FAILED gpt2-cpu, 1 device" in capsys.readouterr().err
    with Ledger(db) as ledger:
        assert ledger.results() == []
