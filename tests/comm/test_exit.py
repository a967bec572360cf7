"""A script that ends without ``dspark.shutdown()`` still leaves the job cleanly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.messages import assert_line_names

# atexit runs its handlers last-registered first: one registered before dspark.init runs after
# DSpark's own, and sees what the interpreter's teardown will find.
_SCRIPT = """
import atexit, torch.distributed as dist, dspark

def after():
    print("process group left:", not dist.is_initialized(), "dspark left:", not dspark.comm.is_initialized())

atexit.register(after)
dspark.init(backend="gloo")
"""


@pytest.mark.slow
def test_the_process_group_is_destroyed_at_exit_without_shutdown() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert_line_names(done.stdout + done.stderr, "process group left: True", "dspark left: True")
