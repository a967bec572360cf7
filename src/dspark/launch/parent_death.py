"""A child that does not outlive its parent: Linux's ``PR_SET_PDEATHSIG``, armed between fork and
exec, makes the kernel send the child a signal the moment the process that started it dies, however
it dies (``kill -9``, the OOM killer), with no handler of the parent's involved.

``dspark run`` arms it twice: on PyTorch's launcher (SIGTERM when ``dspark run`` dies: the launcher
then stops its workers as on any stop) and, through :mod:`dspark.launch.torchrun_entry`, on every
worker (SIGKILL when the launcher dies: nothing supervises the workers any more, and a worker that
trained on, or saved a checkpoint after the job had ended, would race its relaunch).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["stop_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def stop_with_parent(parent: int, signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the kernel send ``signum`` to the child
    once ``parent`` (the pid calling Popen) dies; if ``parent`` died before the call, the child
    sends it to itself. The death that counts is that of the thread calling Popen: call it from a
    thread that lives as long as the process (the main thread). Linux only; None elsewhere.

    Example::

        subprocess.Popen(cmd, preexec_fn=stop_with_parent(os.getpid(), signal.SIGTERM))
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    number = int(signal.Signals(signum))

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, number, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nothing would come
            os.kill(os.getpid(), number)
    return arm
