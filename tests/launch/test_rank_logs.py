"""`dspark run --log-dir DIR [--tee]`: one file per rank, holding that rank's stdout and stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dspark.launch import rank_logs
from dspark.logs import LOG_DIR_ENV

TALKER = """
import os, sys
rank = os.environ["RANK"]
print(f"out from rank {rank}", flush=True)
print(f"err from rank {rank}", file=sys.stderr, flush=True)
print(f"log dir {os.environ['DSPARK_LOG_DIR']}", flush=True)
"""


def _run(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "talk.py"
    script.write_text(TALKER)
    return subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2", *flags,
                           str(script)], capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("tee", [False, True])
def test_each_rank_file_holds_that_ranks_output(tmp_path: Path, tee: bool) -> None:
    logs = tmp_path / "logs"
    (logs).mkdir()
    (logs / "rank-1.log").write_text("a previous job's line\n")
    done = _run(tmp_path, "--log-dir", str(logs), *(["--tee"] if tee else []))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in logs.iterdir()) == ["rank-0.log", "rank-1.log"]
    for rank in (0, 1):
        lines = (logs / f"rank-{rank}.log").read_text().splitlines()
        assert sorted(lines) == sorted([f"out from rank {rank}", f"err from rank {rank}",
                                        f"log dir {logs.resolve()}"]), lines
        shown = done.stdout + done.stderr
        assert (f"out from rank {rank}" in shown) == tee and (f"err from rank {rank}" in shown) == tee


def test_tee_needs_a_log_dir(tmp_path: Path) -> None:
    done = _run(tmp_path, "--tee")
    assert done.returncode == 2 and "--tee" in done.stderr and "--log-dir" in done.stderr


def test_the_workers_read_the_folder_where_dspark_log_dir_looks() -> None:
    assert rank_logs.LOG_DIR_ENV == LOG_DIR_ENV
    assert rank_logs.log_path("logs", 3) == Path("logs/rank-3.log")
