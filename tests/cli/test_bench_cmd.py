"""`dspark bench` actions over a ledger, with the workers stubbed: rerun --stale on dirty trees and
foreign hosts, analysis computed when read, argument checks."""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import pytest

from dspark.bench.ledger.ledger import Ledger
from dspark.bench.measure import provenance, runner
from dspark.bench.measure.provenance import source_commit
from dspark.cli import whole_file
from dspark.cli.main import main
from tests.bench.factory import FakeWorkers, make_measurement
from tests.messages import assert_line_names, assert_names

HERE = socket.gethostname()


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> FakeWorkers:
    commit, dirty = source_commit()
    fake = FakeWorkers(host=HERE, git_commit=commit, git_dirty=dirty)
    monkeypatch.setattr(runner, "run_in_workers", fake)
    return fake


def _ledger_with(tmp_path: Path, *measurements: object) -> str:
    db = tmp_path / "ledger.sqlite"
    with Ledger(db) as ledger:
        ledger.append(list(measurements))  # type: ignore[arg-type]
    return str(db)


def _dirty(monkeypatch: pytest.MonkeyPatch, dirty: bool) -> str:
    commit, _ = source_commit()
    monkeypatch.setattr(provenance, "source_commit", lambda: (commit, dirty))
    return commit


def test_rerun_on_a_dirty_tree_reruns(workers: FakeWorkers, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commit = _dirty(monkeypatch, False)
    db = _ledger_with(tmp_path, make_measurement(num_devices=1, host=HERE, git_commit=commit,
                                                 config_hash="fresh"))
    assert main(["bench", "rerun", "--stale", "--db", db, "--no-progress"]) == 0
    assert "nothing is stale" in capsys.readouterr().out and workers.calls == []
    # Before: "(dirty tree)" was printed and then only other commits' results were looked for.
    _dirty(monkeypatch, True)
    assert main(["bench", "rerun", "--stale", "--db", db, "--no-progress", "--rounds", "1"]) == 0
    printed = capsys.readouterr().out
    assert "re-running 1 configuration(s)" in printed and "uncommitted changes" in printed
    assert [(c.workload, c.num_devices) for c, _, _ in workers.calls] == [("gpt2-cpu", 1)]


def test_rerun_never_replays_another_hosts_rows(workers: FakeWorkers,
                                                monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _dirty(monkeypatch, False)
    db = _ledger_with(tmp_path, make_measurement(num_devices=8, host="gpu-box", git_commit="0" * 40,
                                                 config_hash="eight"))
    assert main(["bench", "rerun", "--stale", "--db", db, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert_line_names(printed, "nothing to rerun", "gpu-box")
    assert "nothing is stale" not in printed and workers.calls == []


def test_rerun_measures_the_baseline_beside_a_stale_n_device_result(
        workers: FakeWorkers, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    commit = _dirty(monkeypatch, False)
    db = _ledger_with(
        tmp_path,
        make_measurement(num_devices=1, host=HERE, git_commit=commit, config_hash="one"),
        make_measurement(num_devices=2, host=HERE, git_commit="0" * 40, config_hash="two",
                         run_id="old"))
    assert main(["bench", "rerun", "--stale", "--db", db, "--no-progress", "--rounds", "2"]) == 0
    assert "with 1 baseline(s)" in capsys.readouterr().out
    assert [(c.num_devices, r) for c, r, _ in workers.calls] == [(1, 0), (2, 0), (2, 1), (1, 1)]
    with Ledger(db) as ledger:
        latest = ledger.resolve("latest")
    from dspark.bench.analyse.analysis import annotate

    one, two = annotate(latest)
    assert two.baseline_result_id == one.result_id
    assert two.round_speedups == [200.0 / 100.0, 201.0 / 101.0]  # the stub: 200 / N + round ms


def test_list_computes_the_speedup_when_read(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    db = _ledger_with(tmp_path,
                      make_measurement(num_devices=1,
                                       step_ms_by_rank=[[300.0, 300.0, 300.0]]),
                      make_measurement(num_devices=2,
                                       step_ms_by_rank=[[100.0] * 3, [100.0] * 3]))
    assert main(["bench", "list", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "3.00x" in out and "suspect_baseline" in out  # a rule no row ever stored


@pytest.mark.parametrize("action", [["list"], ["compare", "a", "b"], ["export", "--json", "out.json"],
                                    ["report", "--report", "out"], []])
def test_a_ledger_path_that_is_no_ledger_is_one_line_and_exit_2(tmp_path: Path, action: list[str],
                                                              workers: FakeWorkers,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A file that is not SQLite, a directory, and (for the commands that only read) a missing file:
    exit 2 with one line naming the path, no traceback, and nothing created."""
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    run = ["--workloads", "gpt2-cpu", "--devices", "1", "--rounds", "1", "--no-progress"] if not action else []
    for db, says in [(junk, "is not a DSpark ledger"), (tmp_path, "is a directory")]:
        assert main(["bench", *action, *run, "--db", str(db)]) == 2
        err = capsys.readouterr().err
        assert says in err and str(db) in err and "Traceback" not in err, err
    assert not workers.calls, "a bench run must refuse the ledger before it measures"
    if action:
        missing = tmp_path / "new" / "ledger.sqlite"
        assert main(["bench", *action, "--db", str(missing)]) == 2
        assert "no ledger at" in capsys.readouterr().err
        assert not missing.parent.exists()


@pytest.mark.parametrize("action", [
    ["--workloads", "gpt2-cpu", "--devices", "1", "--no-progress", "--json", "{file}/x.json"],
    ["--workloads", "gpt2-cpu", "--devices", "1", "--no-progress", "--trace", "{file}"],
    ["--workloads", "gpt2-cpu", "--devices", "1", "--no-progress", "--report", "{file}"],
    ["export", "--json", "{file}/x.json"],
    ["report", "--report", "{file}"],
    ["--workloads", "gpt2-cpu", "--devices", "1", "--no-progress", "--db", "{file}/ledger.sqlite"],
    ["--workloads", "gpt2-cpu", "--devices", "1", "--no-progress", "--json", "/proc/{file}/x.json"],
    ["--workloads", "gpt2-cpu", "--devices", "1", "--no-progress", "--report", "/proc/{file}"],
])
def test_an_output_path_under_a_file_is_refused_before_measuring(tmp_path: Path, action: list[str],
                                                                 workers: FakeWorkers,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--json, --trace, --report and --db at or under an existing file: one line and exit 2 before
    any launch (a --json checked after the run lost it at the end with a traceback)."""
    db = _ledger_with(tmp_path, make_measurement(num_devices=1, config_hash="one"))
    file = tmp_path / "notes.txt"
    file.write_text("x")
    argv = [a.replace("{file}", str(file)) for a in action]
    if "--db" not in argv:
        argv += ["--db", db]
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert str(file) in err and "Traceback" not in err, err
    assert not workers.calls


def test_a_sharded_peer_in_fp16_is_refused_before_launching(workers: FakeWorkers,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # DDP takes fp16 (PyTorch's GradScaler); FSDP2's GradScaler would see one rank's shards only
    assert main(["bench", "--strategies", "torch-ddp,torch-fsdp2", "--precision", "fp16",
                 "--devices", "1", "--workloads", "gpt2-cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert_line_names(err, "--precision fp16", "torch-fsdp2", "GradScaler")
    assert not workers.calls


def test_bad_counts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--rounds", "0", "--no-progress"]) == 2
    assert "'0' must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--steps", "0", "--no-progress"]) == 2


def test_profile_and_trace_reach_the_workers_and_rerun(workers: FakeWorkers,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "ledger.sqlite")
    assert main(["bench", "--workloads", "gpt2-cpu", "--devices", "1", "--rounds", "1", "--precision",
                 "bf16", "--no-progress", "--db", db, "--profile", "--trace", str(tmp_path / "t")]) == 0
    assert workers.options == [{"profile": True,
                                "trace_dir": tmp_path / "t" / "gpt2-cpu-1dev-replicate-bf16-shard32"}]
    assert main(["bench", "--workloads", "gpt2-cpu", "--devices", "1", "--rounds", "1",
                 "--no-progress", "--db", db]) == 0
    assert workers.options[-1] == {"profile": False, "trace_dir": None}
    _dirty(monkeypatch, True)
    assert main(["bench", "rerun", "--stale", "--db", db, "--no-progress", "--rounds", "1",
                 "--profile"]) == 0
    assert workers.options[-1]["profile"] is True
    capsys.readouterr()


def test_help_names_profile_and_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--profile" in text and "straggler" in text
    assert "--trace DIR" in text and "DIR/<configuration>/rank<R>.json" in text


def test_json_into_a_missing_folder_creates_it(workers: FakeWorkers, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the folder was not created, and the write failed after the whole measurement."""
    db = str(tmp_path / "ledger.sqlite")
    out = tmp_path / "new" / "deeper" / "run.json"
    assert main(["bench", "--workloads", "gpt2-cpu", "--devices", "1", "--rounds", "1",
                 "--no-progress", "--db", db, "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 1
    assert main(["bench", "export", "--db", db, "--csv", str(tmp_path / "a" / "b.csv")]) == 0
    assert (tmp_path / "a" / "b.csv").read_text().count("\n") == 2
    capsys.readouterr()


def test_a_write_failing_after_the_run_is_one_line_and_keeps_the_results(
        workers: FakeWorkers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk at the end of a run: the table and the ledger stay, one line says how to write
    the file again, and the exit code says something failed. Also for export, outside a run."""
    db = str(tmp_path / "ledger.sqlite")

    def full_disk(path: Path, *args: object, **kwargs: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    # the --json files go through dspark.cli.whole_file, which opens a hidden sibling first
    monkeypatch.setattr(whole_file, "open", full_disk, raising=False)
    assert main(["bench", "--workloads", "gpt2-cpu", "--devices", "1", "--rounds", "1",
                 "--no-progress", "--db", db, "--json", str(tmp_path / "run.json")]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert_names(captured.err, os.strerror(errno.ENOSPC))
    assert "dspark bench export --run" in captured.err and "recorded in" in captured.out
    with Ledger(Path(db), create=False) as ledger:
        assert len(ledger.results()) == 1
    assert main(["bench", "export", "--db", db, "--json", str(tmp_path / "again.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dspark bench: error: [Errno 28]") and "Traceback" not in err, err
