"""``dspark.launch.process_tree``: the processes below a pid, and a process told apart from a later one
with the same pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dspark.launch.process_tree import (
    children,
    descendants,
    is_running,
    read_process,
    signal_processes,
)

PARENT = ("import subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
          "print('started', flush=True)\n"
          "time.sleep(60)\n")


def test_a_tree_is_found_and_killed_orphans_included() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "started\n"
        tree = descendants(os.getpid())
        # the session's rank pool may be running too: only the new child matters here
        assert parent.pid in [p.pid for p in children(os.getpid())]
        (grandchild,) = descendants(parent.pid)  # in a session of its own, still below parent
        assert [p.pid for p in tree if p.pid in (parent.pid, grandchild.pid)] == [parent.pid, grandchild.pid]
        parent.kill()
        parent.wait()
        assert not is_running(parent.pid)
        assert is_running(grandchild.pid, grandchild.started_at)  # an orphan now, still running
        assert not is_running(grandchild.pid, grandchild.started_at + 1)  # a reused pid is not it
        assert signal_processes([grandchild], signal.SIGKILL) == [grandchild.pid]
        deadline = time.monotonic() + 10
        while is_running(grandchild.pid, grandchild.started_at) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(grandchild.pid, grandchild.started_at)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_this_process_reads_back() -> None:
    me = read_process(os.getpid())
    assert me is not None and me.ppid == os.getppid() and not me.zombie
    assert read_process(2**22 + 7) is None
