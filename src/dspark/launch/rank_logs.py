"""One log file per rank: ``dspark run --log-dir DIR`` writes each worker's stdout and stderr,
interleaved as they came, to ``DIR/rank-<RANK>.log`` (``RANK``: the global rank), and with
``--tee`` shows them on the console as well.

[Note: rank log files] PyTorch's launcher has ``--log-dir`` / ``--redirects`` / ``--tee`` too, but
it nests the files under a random run id, an attempt and the *local* rank, stdout apart from
stderr: on two nodes two files are called ``0/stdout.log``. Here the worker's two pipes are written
by the launcher process itself (:mod:`dspark.launch.torchrun_entry` starts every worker through
:func:`open_worker`), one file per global rank, in one flat folder. A restarted worker (``--max-restarts``)
appends to its file after a line naming the attempt; a new job starts the files afresh. The workers see the folder in
``DSPARK_LOG_DIR`` (what :func:`dspark.log_dir` reads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

__all__ = ["LOG_DIR_ENV", "TEE_ENV", "finish", "log_path", "open_worker"]

LOG_DIR_ENV = "DSPARK_LOG_DIR"
"""Set by ``dspark run --log-dir``; the same name as :data:`dspark.logs.LOG_DIR_ENV`."""
TEE_ENV = "DSPARK_LOG_TEE"
"""``"1"``: the rank logs are shown on the console too (``dspark run --tee``)."""

_copiers: list[threading.Thread] = []


def log_path(log_dir: str | Path, rank: int | str) -> Path:
    """Where rank ``rank``'s output goes.

    Example::

        log_path("logs", 1)   # PosixPath('logs/rank-1.log')
    """
    return Path(log_dir) / f"rank-{rank}.log"


def _copy(pipe: IO[bytes], file: IO[bytes], lock: threading.Lock, console: IO[bytes]) -> None:
    for line in iter(pipe.readline, b""):
        with lock:
            file.write(line)
            file.flush()
        console.write(line)
        console.flush()
    pipe.close()


def open_worker(popen: Callable[..., subprocess.Popen[Any]], *args: Any,
                **kwargs: Any) -> subprocess.Popen[Any]:
    """Start a worker through ``popen`` (``subprocess.Popen``'s signature) with its stdout and stderr
    going to its rank's log file (and, with ``DSPARK_LOG_TEE=1``, to this process's console too);
    a plain ``popen`` call when ``DSPARK_LOG_DIR`` is unset or the caller redirects the output itself.

    Example::

        proc = open_worker(subprocess.Popen, ["python", "train.py"], env={**os.environ, "RANK": "1"})
    """
    log_dir = os.environ.get(LOG_DIR_ENV)
    env: Mapping[str, str] = kwargs.get("env") or os.environ
    if not log_dir or kwargs.get("stdout") is not None or kwargs.get("stderr") is not None:
        return popen(*args, **kwargs)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    # a new job starts its files afresh; a restarted worker appends to its first attempt's
    file = open(log_path(log_dir, env.get("RANK", "0")), "wb" if attempt == "0" else "ab")
    if attempt != "0":
        file.write(f"--- dspark run: attempt {attempt} (the workers were restarted) ---\n".encode())
        file.flush()
    if os.environ.get(TEE_ENV) != "1":
        try:
            return popen(*args, **{**kwargs, "stdout": file, "stderr": file})
        finally:
            file.close()  # the worker holds its own descriptor
    proc = popen(*args, **{**kwargs, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE})
    lock = threading.Lock()
    for pipe, console in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
        thread = threading.Thread(target=_copy, args=(pipe, file, lock, console), daemon=True,
                                  name="dspark-rank-log")
        thread.start()
        _copiers.append(thread)
    return proc


def finish(timeout_s: float = 5.0) -> None:
    """Wait (up to ``timeout_s`` each) for the tee copiers to write what the workers left in their
    pipes: called before the launcher process exits."""
    for thread in _copiers:
        thread.join(timeout_s)
    _copiers.clear()
