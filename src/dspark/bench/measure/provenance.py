"""Where a benchmark result came from: the code, the software, the machine, the time.

The git commit is looked up from the *installed* package's location (``dspark.__file__``), not
from the current directory, so ``dspark bench`` records the code that actually ran wherever it is
started from. A package that is not a tracked file of a git checkout (a wheel in site-packages)
records an empty commit.
"""

from __future__ import annotations

import datetime as _dt
import logging
import platform
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Provenance", "collect_provenance", "device_model", "source_commit"]

_log = logging.getLogger(__name__)
_GIT_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Provenance:
    """The provenance fields of a :class:`dspark.bench.result.BenchResult`."""

    git_commit: str
    """Commit of the DSpark source that ran; ``""`` when it is not a git checkout."""
    git_dirty: bool
    """True when the package's files differ from that commit (edited or untracked files)."""
    dspark_version: str
    torch_version: str
    python_version: str
    host: str
    device_model: str
    """GPU name, or the CPU model from ``/proc/cpuinfo``."""
    backend: str
    """Process-group backend: gloo, nccl, ... (``none`` for the single-process stand-in)."""
    timestamp: str
    """UTC, ISO 8601."""


def _git(package_dir: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True,
                              text=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _log.debug("git %s failed in %s: %s", " ".join(args), package_dir, exc)
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_commit(package_dir: Path | None = None) -> tuple[str, bool]:
    """``(commit, dirty)`` of the git checkout holding the DSpark package, or ``("", False)``
    when the package is not a tracked part of one.

    Example::

        commit, dirty = source_commit()   # ("1e5fe8e0...", False)
    """
    if package_dir is None:
        import dspark

        package_dir = Path(dspark.__file__).resolve().parent
    # A venv inside some other repository would otherwise report that repository's commit.
    if _git(package_dir, "ls-files", "--error-unmatch", "__init__.py") is None:
        return "", False
    commit = _git(package_dir, "rev-parse", "HEAD")
    if not commit:
        return "", False
    status = _git(package_dir, "status", "--porcelain", "--", ".")
    return commit, bool(status)


def device_model(device: torch.device) -> str:
    """A human name for the device: the GPU's name, or the CPU model.

    Example::

        device_model(torch.device("cpu"))   # "AMD EPYC"
    """
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect_provenance(*, device: torch.device, backend: str) -> Provenance:
    """Everything a result records about where it came from, collected now.

    Example::

        prov = collect_provenance(device=world.device, backend=world.backend)
    """
    import dspark

    commit, dirty = source_commit()
    return Provenance(
        git_commit=commit,
        git_dirty=dirty,
        dspark_version=dspark.__version__,
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        host=socket.gethostname(),
        device_model=device_model(device),
        backend=backend,
        timestamp=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
