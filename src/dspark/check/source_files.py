"""Which files ``dspark check`` reads: each file as given, and the Python sources under each
directory; a path that is neither (a FIFO, a device) is refused by name before anything is read."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

__all__ = ["python_files"]


def python_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files to check: each file as given, and the ``*.py`` files under each directory
    (skipping hidden directories, ``__pycache__`` and virtual environments). A path that cannot be
    reached (missing, a symbolic link loop, no permission), cannot be read or listed, or is neither
    a regular file nor a directory (a FIFO, ``/dev/zero``) raises ``ValueError`` naming it.

    Example::

        python_files(["train.py", "src/"])   # [Path('train.py'), Path('src/model.py'), ...]
    """
    if not paths:
        raise ValueError("no path given: pass the files or directories to check")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        try:
            mode = path.stat().st_mode
        except OSError as exc:  # missing, a symbolic link loop, no permission to look
            raise ValueError(f"path {str(raw)!r} {_unreachable(exc)} (looked for "
                             f"{os.path.abspath(path)!r})") from None
        if stat.S_ISREG(mode):
            if not os.access(path, os.R_OK):
                raise ValueError(f"path {str(raw)!r} cannot be read: permission denied")
            files.append(path)
        elif stat.S_ISDIR(mode):
            try:
                next(os.scandir(path), None)
            except OSError as exc:
                raise ValueError(f"directory {str(raw)!r} cannot be listed: {exc.strerror}") from None
            files += sorted(f for f in path.rglob("*.py") if f.is_file() and not _skipped(f, path))
        else:  # a FIFO, a device, a socket: reading it could block or never end
            raise ValueError(f"path {str(raw)!r} is not a regular file or a directory "
                             f"({_kind(path)}); pass Python source files or directories")
    return files


def _unreachable(exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return "does not exist"
    if exc.errno == errno.ELOOP:
        return "is a symbolic link loop (or a chain of links too long to follow)"
    return f"cannot be reached: {exc.strerror}"


def _kind(path: Path) -> str:
    if path.is_fifo():
        return "a FIFO"
    if path.is_char_device() or path.is_block_device():
        return "a device"
    return "a socket" if path.is_socket() else "something else"


def _skipped(file: Path, root: Path) -> bool:
    for parent in file.relative_to(root).parents:
        if parent == Path("."):
            continue
        name = parent.name
        if name.startswith(".") or name == "__pycache__" or (root / parent / "pyvenv.cfg").exists():
            return True
    return False
