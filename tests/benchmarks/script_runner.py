"""Runs many benchmark scripts in one pair of processes, as ``tests/benchmarks/test_scripts.py``
launches it: ``python tests/benchmarks/script_runner.py PLAN.json RESULTS_DIR``, once per rank, with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and their kin set as a launcher sets them.

[Note: scripts in one launch]
Starting a fresh pair of ranks costs seconds (PyTorch's import alone), a script with its smallest
arguments a fraction of one. So each rank runs every script of the plan in turn with ``runpy``, as
``python benchmarks/NAME.py ARGS`` would (``__name__ == "__main__"``, ``sys.argv``): first the
scripts run on both ranks, each joining a fresh process group (``dspark.init()``), then the
one-process scripts, each on the rank the plan gives it, with the launcher's variables removed
(DSpark's world of one); a script the two-rank ones need first (weights written to disk) runs on
rank 0 before them. A
process group cannot be formed twice over one store (the second finds the first's keys), so
before each two-rank script rank 0 picks a free port and both read it from a file under
RESULTS_DIR. Between scripts the environment, the working directory and the CPU affinity (the lab
pins threads to a core) are put back. Each script's printed output goes to
``RESULTS_DIR/NAME.rankR.txt`` and its outcome (wall and CPU seconds, children included) to
``RESULTS_DIR/NAME.rankR.json`` (NAME: the plan entry's name, the script's unless one script runs
twice).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import runpy
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_USE_AGENT_STORE")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _agree_on_a_port(results: Path, name: str, rank: int) -> str:
    port_file = results / f"{name}.port"
    if rank == 0:
        ready = port_file.with_suffix(".tmp")
        ready.write_text(str(_free_port()))
        ready.rename(port_file)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 never wrote {port_file}")
        time.sleep(0.01)
    return port_file.read_text()


def _cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _leave_the_group() -> None:
    from dspark import comm

    if comm.is_initialized():
        with contextlib.suppress(Exception):
            comm.shutdown()


def _run(entry: dict[str, Any], results: Path, rank: int) -> None:
    name, script, args = entry["name"], entry["script"], [str(a) for a in entry["args"]]
    path = ROOT / "benchmarks" / f"{script}.py"
    environ, cwd, cores = dict(os.environ), os.getcwd(), os.sched_getaffinity(0)
    argv = sys.argv
    started, cpu = time.perf_counter(), _cpu_s()
    outcome: dict[str, object] = {"name": name, "rank": rank, "ok": True, "error": ""}
    with open(results / f"{name}.rank{rank}.txt", "w") as log, contextlib.redirect_stdout(log):
        try:
            sys.argv = [str(path), *args]
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                outcome.update(ok=False, error=f"SystemExit({exc.code!r})")
        except BaseException:
            outcome.update(ok=False, error=traceback.format_exc())
        finally:
            _leave_the_group()  # a script that failed before its dspark.shutdown()
            sys.argv = argv
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            os.sched_setaffinity(0, cores)
    outcome["seconds"] = round(time.perf_counter() - started, 2)
    outcome["cpu_s"] = round(_cpu_s() - cpu, 2)
    (results / f"{name}.rank{rank}.json").write_text(json.dumps(outcome))


def main() -> None:
    plan, results = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    launched = {name: os.environ[name] for name in LAUNCHER_VARIABLES if name in os.environ}
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    for entry in plan["first"] if rank == 0 else ():  # what the two-rank scripts then read
        _run(entry, results, rank)
    os.environ.update(launched)
    for entry in plan["both"]:
        os.environ["MASTER_PORT"] = _agree_on_a_port(results, entry["name"], rank)
        _run(entry, results, rank)
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    for entry in plan[f"rank{rank}"]:
        _run(entry, results, rank)


if __name__ == "__main__":
    main()
