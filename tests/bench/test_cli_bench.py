"""`dspark bench` end to end: one tiny seed suite through the real CLI, launcher and workers.

The suite (gpt2-cpu, global batch 4, 1 warm-up and 2 timed steps, 2 rounds; 1 device, 2 devices
with the batch replicated, 2 sharded; with `--profile` and `--trace`) runs once per module, from a
directory that is not the repository, and every test reads what it left: the JSON, the ledger,
the printed tables, the traces.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.ledger.ledger import Ledger
from dspark.bench.measure.provenance import source_commit
from dspark.cli.main import main
from dspark.comm.shm_setup import shm_wanted
from dspark.engine import STEP_STATS_KEYS
from tests.messages import assert_line_names, assert_names

pytestmark = [pytest.mark.slow, pytest.mark.serial]

TINY = ["--workloads", "gpt2-cpu", "--global-batch", "4", "--warmup", "1", "--steps", "2",
        "--rounds", "2", "--no-progress"]

# The keys issue 4 requires of every result object, and issue 12's rounds and measured facts.
REQUIRED_KEYS = {
    "workload", "num_devices", "strategy", "precision", "batch_placement", "global_batch",
    "step_ms", "step_ms_p10", "step_ms_p90", "samples_per_s", "peak_bytes_per_rank",
    "model_state_bytes_per_rank", "speedup", "efficiency", "anomalies", "git_commit", "git_dirty",
    "dspark_version", "torch_version", "python_version", "host", "device_model", "backend",
    "config_hash", "timestamp", "result_id", "step_ms_by_round", "speedup_min", "speedup_max",
    "baseline_result_id", "peak_rss_bytes_per_rank", "samples_by_rank", "identical_input_ranks",
    "core_foreign_share_by_round",
}


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    where = tmp_path_factory.mktemp("elsewhere")
    db, out, traces = where / "ledger.sqlite", where / "results.json", where / "traces"
    done = subprocess.run(
        [sys.executable, "-m", "dspark.cli.main", "bench", "--suite", "seed", *TINY,
         "--db", str(db), "--json", str(out), "--profile", "--trace", str(traces)],
        cwd=where, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    rows = json.loads(out.read_text())
    by_run = {(r["num_devices"], r["batch_placement"]): r for r in rows}
    return {"where": where, "db": db, "rows": rows, "by_run": by_run, "stdout": done.stdout,
            "traces": traces}


def test_json_has_every_key_and_every_step_of_every_round(seed_run: dict[str, Any]) -> None:
    assert len(seed_run["rows"]) == 3
    for row in seed_run["rows"]:
        assert REQUIRED_KEYS <= row.keys(), REQUIRED_KEYS - row.keys()
        assert row["rounds"] == 2 and [len(s) for s in row["step_ms_by_round"]] == [2, 2]
        assert row["git_commit"] == source_commit()[0]  # from the package, not the cwd
        # 2 ranks of one machine: DSpark's collectives go through shared memory (dspark.comm)
        shared = row["num_devices"] > 1 and shm_wanted(2, 2, "gloo", "cpu")
        assert row["backend"] == ("gloo+shm" if shared else "gloo") and row["device_model"]
        assert row["optimizer_kernel"] == "fused"
        if len(os.sched_getaffinity(0)) >= 2:  # one core per rank: every thread on it
            assert row["ranks_pinned"] and row["threads_unpinned"] == 0
        assert all(share is not None for share in row["core_foreign_share_by_round"])


def test_the_replicated_batch_is_measured_not_read_from_the_label(seed_run: dict[str, Any]) -> None:
    bug = seed_run["by_run"][(2, "replicate")]
    assert bug["samples_by_rank"] == [4, 4] and bug["identical_input_ranks"] == [[0, 1]]
    assert "replicated_batch" in [a["kind"] for a in bug["anomalies"]]
    assert bug["engine_options"].get("batch_check_every", None) is None
    fixed = seed_run["by_run"][(2, "shard")]
    assert fixed["samples_by_rank"] == [2, 2] and fixed["identical_input_ranks"] == []
    assert "replicated_batch" not in [a["kind"] for a in fixed["anomalies"]]


def test_speedup_baseline_memory_and_traffic(seed_run: dict[str, Any]) -> None:
    one, fixed = seed_run["by_run"][(1, "shard")], seed_run["by_run"][(2, "shard")]
    assert fixed["baseline_result_id"] == one["result_id"] != fixed["result_id"]
    assert len(fixed["round_speedups"]) == 2
    assert one["comm_bytes_per_step"] == 0 and one["bus_bytes_per_s"] == 0
    assert fixed["comm_bytes_per_step"] > 0 and fixed["bus_bytes_per_s"] > 0
    # Replicate strategy: the gradient all-reduce carries at least the whole fp32 gradient.
    assert fixed["comm_bytes_per_step"] >= fixed["model_state_parts"]["grads"][0]
    # What the walk found is exactly what the replicate formula needs, on every configuration.
    for row in seed_run["rows"]:
        assert row["model_state_bytes_per_rank"] == row["model_state_bytes_expected_per_rank"] > 0
        assert row["peak_rss_bytes_per_rank"] > row["peak_bytes_per_rank"] > 0
    assert one["peak_bytes_per_rank"] > fixed["peak_bytes_per_rank"]


def test_seed_table_and_verdicts_are_printed(seed_run: dict[str, Any]) -> None:
    assert "bug (batch replicated)" in seed_run["stdout"]
    assert "replicated batch: FLAGGED" in seed_run["stdout"]


def test_profile_gives_every_rank_its_breakdown_and_host(seed_run: dict[str, Any]) -> None:
    for row in seed_run["rows"]:
        n = row["num_devices"]
        assert row["profiled"] and row["hosts_by_rank"] == [socket.gethostname()] * n
        assert len(row["phase_ms_by_rank"]) == len(row["compute_ms_range_by_rank"]) == n
        for phases in row["phase_ms_by_rank"]:
            assert set(phases) == set(STEP_STATS_KEYS) and phases["compute_ms"] > 0
    assert_names(seed_run["stdout"], "Step breakdown per rank", "median ms")


def test_a_healthy_run_has_no_straggler_of_its_own_making(seed_run: dict[str, Any]) -> None:
    # Both 2-device runs give each rank the same work, so DSpark makes no straggler: a rank given
    # more work (a second pass, a rank-0-only extra) computes about twice as long. A core shared
    # with other processes does make a real one, and the rule then says so (busy_machine names the
    # load too); so does a VM's vCPU that the hypervisor serves less than the other, which no
    # counter of the guest shows (seen on a 2-vCPU VM: 1.32x where 1.87x was due). The bound below
    # tells the two apart.
    for row in seed_run["rows"]:
        kinds = [a["kind"] for a in row["anomalies"]]
        for found in row["anomalies"]:
            if found["kind"] == "straggler" and "busy_machine" not in kinds:
                assert found["compute_ms"] < 1.5 * found["others_compute_ms"], found


def test_each_configuration_has_a_trace_per_rank_naming_the_phases(
        seed_run: dict[str, Any]) -> None:
    for row in seed_run["rows"]:
        where = seed_run["traces"] / (f"gpt2-cpu-{row['num_devices']}dev-replicate-bf16-"
                                      f"{row['batch_placement']}4")
        assert sorted(p.name for p in where.iterdir()) == [
            f"rank{r}.json" for r in range(row["num_devices"])]
        for path in where.iterdir():
            names = {event.get("name") for event in json.loads(path.read_text())["traceEvents"]}
            assert {"dspark.forward", "dspark.backward", "dspark.optimizer"} <= names
            if row["num_devices"] > 1:
                assert {"dspark.bucket0.all_reduce", "dspark.comm.wait"} <= names
    assert_line_names(" ".join(seed_run["stdout"].split()), "traces of gpt2-cpu", "2 devices", "replicate",
                      "bf16", "batch 4 shard", str(seed_run["traces"]))


def test_the_replicated_run_is_explained_by_the_engines_audit(seed_run: dict[str, Any]) -> None:
    line = "engine.audit() on rank 0: input batch: 2.0x a 1/2 share, replicated on every rank"
    [message] = [a["message"] for a in seed_run["by_run"][(2, "replicate")]["anomalies"]
                 if a["kind"] == "replicated_batch"]
    assert line in message and line in " ".join(seed_run["stdout"].split())
    for key in ((1, "shard"), (2, "shard")):
        audits = seed_run["by_run"][key]["audit_by_rank"]
        assert len(audits) == key[0] and all(a["rows_checked"] > 0 and a["above_share"] == []
                                             for a in audits)


def test_the_ledger_keeps_raw_rounds_and_reads_back_the_same_results(
        seed_run: dict[str, Any]) -> None:
    with Ledger(seed_run["db"]) as ledger:
        raw = ledger.measurements()
        again = annotate(ledger.results(), history=ledger)
    assert len(raw) == 6 and all(len(m.step_ms_by_rank) == m.num_devices for m in raw)
    assert [m.round_index for m in raw] == [0, 0, 0, 1, 1, 1]
    assert sum(m.batch is not None for m in raw) == 3  # the probe runs in the first round only
    assert [r.to_dict() for r in again] == seed_run["rows"]


def test_list_compare_export_report(seed_run: dict[str, Any], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "copy.sqlite"
    run_id = seed_run["rows"][0]["run_id"]
    with Ledger(seed_run["db"]) as source, Ledger(db) as copy:
        measured = source.measurements()
        # An older run of the same code, three times slower: the latest is faster than it.
        copy.append([dataclasses.replace(m, run_id="older", timestamp="2026-01-01T00:00:00+00:00",
                                         step_ms_by_rank=[[3 * ms for ms in steps]
                                                          for steps in m.step_ms_by_rank])
                     for m in measured])
        copy.append(measured)
    assert main(["bench", "list", "--db", str(db)]) == 0
    assert capsys.readouterr().out.count(run_id) == 3
    assert main(["bench", "compare", "older", "latest", "--db", str(db)]) == 0
    assert_line_names(capsys.readouterr().out, "3 faster", "0 slower", "0 within noise")
    assert main(["bench", "--db", str(db), "export", "--csv", str(tmp_path / "r.csv")]) == 0
    with open(tmp_path / "r.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 6 and REQUIRED_KEYS <= table[0].keys()
    assert main(["bench", "export", "--json", str(tmp_path / "r.json"), "--run", run_id,
                 "--db", str(seed_run["db"])]) == 0
    assert json.loads((tmp_path / "r.json").read_text()) == seed_run["rows"]
    assert main(["bench", "report", "--report", str(tmp_path / "html"), "--db", str(db)]) == 0
    page = (tmp_path / "html" / "index.html").read_text()
    assert "<h2>Anomalies</h2>" in page and "<h2>Step breakdown per rank</h2>" in page
    assert (tmp_path / "html" / "breakdown.png").is_file()


def test_bad_input_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workloads", "nope", "--no-progress"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err
    assert main(["bench", "--devices", "1,64"]) == 2
    assert "needs 64 devices" in capsys.readouterr().err


def test_a_failed_configuration_makes_the_exit_code_1(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dspark.bench.measure import runner

    def fail(config: Any, **_: Any) -> runner.RunFailure:
        return runner.RunFailure(config=config, exit_code=1, stderr_tail="rank 0: Traceback ...")

    monkeypatch.setattr(runner, "run_in_workers", fail)
    db = tmp_path / "ledger.sqlite"
    assert main(["bench", *TINY, "--devices", "1", "--db", str(db)]) == 1
    assert "FAILED gpt2-cpu, 1 device" in capsys.readouterr().err
    with Ledger(db) as ledger:
        assert ledger.results() == []
