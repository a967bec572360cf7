"""Without the lab's extra (``dspark[lab]``: matplotlib), the commands that draw a figure stop before
doing anything, in one line naming the install; the rest of the lab (the ledger) works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.bench.ledger.ledger import Ledger
from tests.bench.factory import append_run
from tests.messages import assert_names

INSTALL = "pip install 'dspark[lab]'"


@pytest.mark.slow
def test_commands_that_draw_name_the_lab_extra_when_matplotlib_is_missing(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.sqlite"
    with Ledger(ledger) as opened:
        append_run(opened)
    commands = {
        "plan --plot": ["plan", "--workload", "gpt2-cpu", "--devices", "1,2", "--plot", str(tmp_path / "p.png")],
        "bench --report": ["bench", "--suite", "quick", "--db", str(tmp_path / "new.sqlite"),
                           "--report", str(tmp_path / "report"), "--no-progress"],
        "bench report": ["bench", "report", "--db", str(ledger), "--report", str(tmp_path / "report")],
        "bench list": ["bench", "list", "--db", str(ledger)],
    }
    # as if matplotlib were not installed: an import of it raises ModuleNotFoundError
    script = ("import json, sys\nsys.modules['matplotlib'] = None\nfrom dspark.cli.main import main\n"
              f"for name, argv in {commands!r}.items():\n"
              "    print(json.dumps([name, main(argv)]), file=sys.stderr, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    exits = dict(json.loads(line) for line in lines if line.startswith("["))
    assert exits == {"plan --plot": 2, "bench --report": 2, "bench report": 2, "bench list": 0}, done.stderr
    errors = [line for line in lines if not line.startswith("[")]
    assert len(errors) == 3, errors  # one line each, no traceback
    for command, line in zip(("dspark plan", "dspark bench", "dspark bench"), errors, strict=True):
        assert line.startswith(f"{command}: error: "), line
        assert_names(line, "matplotlib", INSTALL)
    assert not (tmp_path / "new.sqlite").exists(), "the suite ran before the report's figures failed"
