"""`dspark.launch.launcher`: the torchrun argv and environment, without launching (pure logic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.launch.launcher import LaunchSpec, launch, launcher_argv, launcher_command, launcher_env
from dspark.launch.torchrun_entry import split_argv
from tests.messages import assert_names


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_single_node_defaults_to_loopback_on_a_free_port(script: str) -> None:
    argv = launcher_argv(LaunchSpec(target=script, nproc=2))
    assert _flag(argv, "--nproc-per-node") == "2" and _flag(argv, "--nnodes") == "1"
    assert _flag(argv, "--master-addr") == "127.0.0.1"
    port = int(_flag(argv, "--master-port"))
    assert 1024 <= port <= 65535 and port != 29500
    assert argv[-1] == script and "-m" not in argv


def test_script_arguments_pass_untouched_after_the_script(script: str) -> None:
    args = ("--strategy", "zero2", "--", "-m", "--nproc", "7")
    argv = launcher_argv(LaunchSpec(target=script, nproc=1, args=args))
    assert argv[argv.index(script):] == [script, *args]
    assert _flag(argv, "--nproc-per-node") == "1"


def test_module_target_runs_with_dash_m() -> None:
    argv = launcher_argv(LaunchSpec(target="dspark.bench.measure.worker", module=True, nproc=2,
                                    args=("--config", "{}")))
    assert argv[-4:] == ["-m", "dspark.bench.measure.worker", "--config", "{}"]
    command = launcher_command(LaunchSpec(target="a.b", module=True, nproc=1, args=("--nproc", "3")))
    assert command[1:3] == ["-m", "dspark.launch.torchrun_entry"]
    launcher, script = split_argv(command[3:])
    assert launcher[-2:] == ["-m", "a.b"] and script == ["--nproc", "3"]


def test_torchrun_entry_parses_only_the_launcher_arguments() -> None:
    assert split_argv(["3", "--nproc-per-node", "2", "t.py", "--nproc", "5"]) == (
        ["--nproc-per-node", "2", "t.py"], ["--nproc", "5"])
    assert split_argv(["1", "t.py"]) == (["t.py"], [])
    for bad in ([], ["x", "t.py"], ["0", "t.py"], ["3", "t.py"]):
        with pytest.raises(SystemExit) as caught:
            split_argv(bad)
        assert_names(str(caught.value), "usage:", "dspark.launch.torchrun_entry")


def test_multi_node_passes_master_and_node_rank_through(script: str) -> None:
    argv = launcher_argv(LaunchSpec(target=script, nproc=4, nnodes=2, node_rank=1,
                                    master_addr="node0", max_restarts=3))
    assert (_flag(argv, "--nnodes"), _flag(argv, "--node-rank"), _flag(argv, "--master-addr"),
            _flag(argv, "--master-port"), _flag(argv, "--max-restarts")) == ("2", "1", "node0", "29500", "3")
    c10d = launcher_argv(LaunchSpec(target=script, nproc=4, nnodes=2, rdzv_endpoint="node0:29400",
                                    rdzv_id="job7"))
    assert (_flag(c10d, "--rdzv-backend"), _flag(c10d, "--rdzv-endpoint"), _flag(c10d, "--rdzv-id")) == (
        "c10d", "node0:29400", "job7")
    assert "--master-addr" not in c10d


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"nproc": 0}, "nproc=0 must be >= 1"),
    ({"nproc": True}, "nproc=True must be an int"),
    ({"nnodes": 2}, "nnodes=2 needs master_addr"),
    ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "node_rank=2 must be in [0, nnodes=2)"),
    ({"master_port": 70000}, "master_port=70000"),
    ({"max_restarts": -1}, "max_restarts=-1"),
    ({"grace_period_s": 0}, "grace_period_s=0 must be a positive number of seconds"),
    ({"rdzv_endpoint": "h:1", "master_addr": "h"}, "not both"),
    ({"target": "missing.py"}, "script 'missing.py' does not exist"),
    ({"target": "not a module", "module": True}, "not a dotted module name"),
    ({"agent": False}, "agent=False runs one process on one node without restarts; got nproc=2"),
])
def test_bad_specs_are_rejected_with_the_value(script: str, kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"target": script, "nproc": 2, **kwargs}
    with pytest.raises((ValueError, TypeError)) as info:
        LaunchSpec(**fields)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_env_sets_omp_threads_only_when_unset() -> None:
    assert launcher_env({"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert launcher_env({"OMP_NUM_THREADS": "4"}) == {"OMP_NUM_THREADS": "4"}
    assert launcher_env({"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == "1"


@pytest.mark.slow
def test_a_one_process_job_without_the_agent_joins_a_real_one_rank_group(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import dspark, os, sys\n"
        "world = dspark.init()\n"
        "print(world.backend, world.world_size, os.environ['LOCAL_WORLD_SIZE'],\n"
        "      os.environ['MASTER_ADDR'], 'torch.distributed.run' in ' '.join(sys.orig_argv))\n"
        "dspark.shutdown()\n")
    spec = LaunchSpec(target=str(probe), nproc=1, agent=False)
    assert launcher_command(spec)[1:] == [str(probe)]
    done = launch(spec, capture=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["gloo", "1", "1", "127.0.0.1", "False"]
