"""`dspark run`: argument parsing into a launch spec, and real launches through torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dspark
from dspark.cli.main import build_parser, main
from dspark.cli.run_cmd import launch_plan, spec_from_args
from dspark.launch.launcher import LaunchSpec, launch
from tests.messages import assert_line_names, assert_names

_RANK_1_ERROR = "bad thing on rank 1"
"""What the one-rank script raises on rank 1 (the launcher shows the worker's traceback)."""

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hello_distributed.py"


def _spec(*argv: str) -> LaunchSpec:
    return spec_from_args(build_parser().parse_args(["run", *argv]))


def test_parsing_keeps_script_arguments_untouched(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    spec = _spec("--nproc", "2", "--max-restarts", "1", "--grace-period", "12.5", str(script),
                 "--strategy", "zero2", "--", "--nproc", "9", "-h")
    assert (spec.target, spec.nproc, spec.max_restarts, spec.module) == (str(script), 2, 1, False)
    assert spec.grace_period_s == 12.5 and _spec("--nproc", "1", str(script)).grace_period_s == 30.0
    assert spec.args == ("--strategy", "zero2", "--", "--nproc", "9", "-h")
    # a "--" before the script separates it from dspark's options and is not the script
    assert _spec("--nproc", "1", "--", str(script), "a").args == ("a",)


def test_parsing_multi_node_and_module_targets() -> None:
    spec = _spec("--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                 "--master-port", "29501", "-m", "dspark.bench.measure.worker", "--out", "x.json")
    assert (spec.nproc, spec.nnodes, spec.node_rank, spec.master_addr, spec.master_port) == (
        8, 2, 1, "10.0.0.1", 29501)
    assert (spec.module, spec.target, spec.args) == (True, "dspark.bench.measure.worker", ("--out", "x.json"))


def test_dry_run_prints_the_torchrun_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--dry-run", "--nproc", "3", "--oversubscribe", str(EXAMPLE), "--flag"]) == 0
    out = capsys.readouterr().out
    assert "-m dspark.launch.torchrun_entry" in out and "--nproc-per-node 3" in out
    assert out.rstrip().endswith(f"{EXAMPLE} --flag")


def test_help_states_the_default_collective_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    assert main(["run", "--help"]) == 0
    default = inspect.signature(dspark.init).parameters["timeout"].default
    assert_names(" ".join(capsys.readouterr().out.split()), f"{default:g} s by default",
                 "dspark.init(timeout=SECONDS)")


SCRIPT_FLAGS = ["--nproc", "5", "--master", "1", "--nproc=7", "--max", "3", "--log", "x.txt", "--", "-m"]
"""Flags a training script may well have: exact names and abbreviations of both dspark run's options
(``--master`` abbreviates ``--master-addr`` and ``--master-port``) and torchrun's (``--nproc``,
``--max``, ``--log`` abbreviate several of its own), which either parser stopped on as ambiguous."""


@pytest.mark.slow
def test_the_scripts_own_flags_reach_it_untouched_on_two_ranks(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import json, pathlib, sys, dspark\nw = dspark.init()\n"
                     "pathlib.Path(f'argv{w.rank}.json').write_text(json.dumps(sys.argv[1:]))\n"
                     "dspark.shutdown()\n")
    done = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2", str(probe),
                           *SCRIPT_FLAGS], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    import json
    for rank in range(2):
        assert json.loads((tmp_path / f"argv{rank}.json").read_text()) == SCRIPT_FLAGS, rank


SLURM_NODE_1 = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
                "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "4"}


def test_slurm_fills_what_the_command_line_leaves_unset() -> None:
    args = build_parser().parse_args(["run", str(EXAMPLE)])
    spec, from_slurm = launch_plan(args, SLURM_NODE_1)
    assert (spec.nproc, spec.nnodes, spec.node_rank, spec.master_addr) == (4, 2, 1, "gpu07")
    assert len(from_slurm) == 4
    given = build_parser().parse_args(["run", "--nproc", "1", "--node-rank", "0", "--master-addr", "h",
                                       str(EXAMPLE)])
    spec = spec_from_args(given, SLURM_NODE_1)
    assert (spec.nproc, spec.nnodes, spec.node_rank, spec.master_addr) == (1, 2, 0, "h")
    outside = spec_from_args(build_parser().parse_args(["run", "--nproc", "2", str(EXAMPLE)]), {})
    assert (outside.nnodes, outside.node_rank, outside.master_addr) == (1, 0, None)


def test_dry_run_under_slurm_prints_what_it_took(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SLURM_NODE_1.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--dry-run", str(EXAMPLE)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("dspark run: ") and captured.err.count("\n") == 1, captured.err
    assert_line_names(captured.err, "Slurm", "nnodes=2 (SLURM_JOB_NUM_NODES)",
                      "nproc=4 (SLURM_GPUS_ON_NODE)", "node_rank=1 (SLURM_NODEID)",
                      "master_addr=gpu07", "SLURM_JOB_NODELIST=gpu[07-08]")
    assert "--nnodes 2 --nproc-per-node 4" in captured.out
    assert_names(captured.out, "--node-rank 1", "--master-addr gpu07", "--master-port 29500")


def test_nproc_is_required_outside_slurm(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    assert main(["run", "--dry-run", str(EXAMPLE)]) == 2
    assert "--nproc N is required" in capsys.readouterr().err


@pytest.mark.slow
def test_dspark_run_hello_distributed_on_two_ranks_from_another_cwd(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2", str(EXAMPLE)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert sorted(line.split(":")[0] for line in lines) == ["rank 0/2 [gloo]", "rank 1/2 [gloo]"], done.stdout
    for line in lines:
        assert "full() == whole: True" in line and "shard_dim=None refused: PlacementError" in line
    assert "batch rows [0, 1, 2, 3] of 8" in done.stdout and "batch rows [4, 5, 6, 7] of 8" in done.stdout


@pytest.mark.slow
def test_example_runs_as_a_plain_process() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("rank 0/1 [none]") and "refused: PlacementError" in done.stdout


@pytest.mark.slow
def test_launch_runs_a_module_target_with_its_arguments_and_omp_threads(tmp_path: Path) -> None:
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(
        "import os, sys\n"
        "sys.stdout.write(f\"{os.environ['RANK']} {os.environ['WORLD_SIZE']} "
        "{os.environ['OMP_NUM_THREADS']} {' '.join(sys.argv[1:])}\\n\")\n"
        "sys.exit(int(os.environ.get('PROBE_EXIT', '0')))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    spec = LaunchSpec(target="probe_pkg.probe", module=True, nproc=2, args=("--strategy", "zero2", "-m"))
    done = launch(spec, env=env, capture=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split("\n")[:2]) == ["0 2 1 --strategy zero2 -m", "1 2 1 --strategy zero2 -m"]
    # a failing worker: its exit code comes back, with one line naming it, and this process
    # survives it (before: exit code 1 and torchrun's own traceback last on the screen)
    failed = launch(LaunchSpec(target="probe_pkg.probe", module=True, nproc=1),
                    env={**env, "PROBE_EXIT": "3"}, capture=True)
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert_line_names(failed.stderr, "dspark run: probe_pkg.probe", "failed", "rank 0",
                      "local rank 0", "pid ", "code 3", "first to fail", "error output")
    assert "Traceback" not in failed.stderr and "ChildFailedError" not in failed.stderr
    assert dspark.__version__  # still here


@pytest.mark.slow
def test_a_worker_killed_or_raising_on_one_rank_is_named(tmp_path: Path) -> None:
    script = tmp_path / "one_rank.py"
    script.write_text("import os, signal, sys\n"
                      "rank = int(os.environ['RANK'])\n"
                      "if rank == 1 and sys.argv[1] == 'raise':\n"
                      f"    raise ValueError({_RANK_1_ERROR!r})\n"
                      "if rank == 0 and sys.argv[1] == 'kill':\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "import time; time.sleep(0 if sys.argv[1] == 'raise' else 30)\n")
    raised = launch(LaunchSpec(target=str(script), nproc=2, args=("raise",)), capture=True)
    assert raised.returncode == 1, raised.stderr[-3000:]
    assert_names(raised.stderr, f"ValueError: {_RANK_1_ERROR}")  # the worker's own traceback
    last = raised.stderr.strip().splitlines()[-1]
    assert_line_names(last, f"dspark run: {script}", "rank 1", "local rank 1")
    killed = launch(LaunchSpec(target=str(script), nproc=2, args=("kill",)), capture=True)
    assert killed.returncode == 128 + 9, killed.stderr[-3000:]
    last = killed.stderr.strip().splitlines()[-1]
    assert_line_names(last, "rank 0", "local rank 0", "SIGKILL", "first")
    assert_line_names(last, "; rank 1", "stopped", "SIGTERM")


@pytest.mark.slow
def test_a_master_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    script = tmp_path / "noop.py"
    script.write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2",
                               "--master-port", str(port), str(script)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert_line_names(done.stderr, "dspark run:", "rendezvous", "before any worker started")
    assert "EADDRINUSE" in done.stderr and "choose another --master-port" in done.stderr


def test_more_workers_than_devices_is_refused_unless_oversubscribed(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dspark.cli import run_cmd
    from dspark.launch import devices

    script = tmp_path / "noop.py"
    script.write_text("")
    started = []
    monkeypatch.setattr(run_cmd, "launch", lambda spec: started.append(spec.nproc) or 0)
    monkeypatch.setattr(devices, "local_devices", lambda: devices.LocalDevices(gpus=0, cores=2))
    assert main(["run", "--nproc", "100000", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--nproc 100000" in err and "2 CPU core(s)" in err and "--nproc 2 or fewer" in err, err
    assert "--oversubscribe" in err and not started
    assert main(["run", "--nproc", "6", "--oversubscribe", str(script)]) == 0
    assert main(["run", "--nproc", "2", str(script)]) == 0
    assert started == [6, 2] and "warning" not in capsys.readouterr().err


def test_command_line_messages_speak_in_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-m with a path said 'pass module=False'; --rdzv-id without --rdzv-endpoint was dropped
    without a word; SLURM_GPUS_ON_NODE=0 was called unset."""
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError) as caught:
        _spec("--nproc", "2", "-m", "foo/bar.py")
    assert_names(str(caught.value), "-m", "foo/bar.py")
    with pytest.raises(ValueError) as caught:
        _spec("--nproc", "2", "--rdzv-id", "myjob", str(script))
    assert_names(str(caught.value), "--rdzv-id myjob", "c10d")
    assert _spec("--nproc", "2", "--rdzv-id", "myjob", "--rdzv-endpoint", "h:29400",
                 str(script)).rdzv_id == "myjob"
    assert _spec("--nproc", "2", str(script)).rdzv_id == "dspark"
    slurm = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "a[1-2]",
             "SLURM_GPUS_ON_NODE": "0"}
    with pytest.raises(ValueError, match=r"no count.*SLURM_GPUS_ON_NODE='0'"):
        spec_from_args(build_parser().parse_args(["run", str(script)]), slurm)


def _failures(**exitcodes: int) -> object:
    """A stand-in for torchrun's ChildFailedError: ``rank<N>=exitcode``, the first one first."""
    from types import SimpleNamespace
    failures = {int(k[4:]): SimpleNamespace(local_rank=int(k[4:]), pid=100 + int(k[4:]), exitcode=code)
                for k, code in exitcodes.items()}
    first = min(failures)
    return SimpleNamespace(name="train.py", failures=failures,
                           get_first_failure=lambda: (first, failures[first]))


def test_a_worker_killed_by_sigterm_is_told_how_to_stop_cleanly() -> None:
    from dspark.launch.torchrun_entry import describe_failure
    line, code = describe_failure(_failures(rank0=-15, rank1=-15))
    assert code == 143
    assert_line_names(line, "rank 0", "local rank 0", "pid 100", "killed", "SIGTERM")
    assert_line_names(line, "rank 1", "stopped", "SIGTERM")
    assert "dspark.preemption_requested()" in line
    line, code = describe_failure(_failures(rank0=3))
    assert code == 3 and "exited with code 3" in line and "preemption_requested" not in line
