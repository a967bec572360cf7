"""Which files ``dspark check`` reads: each file as given, and the Python sources under each
directory; a path that is neither (a FIFO, a device) is refused by name before anything is read."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["python_files"]


def python_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files to check: each file as given, and the ``*.py`` files under each directory
    (skipping hidden directories, ``__pycache__`` and virtual environments). A path that does not
    exist, or is neither a regular file nor a directory (a FIFO, ``/dev/zero``), raises
    ``ValueError`` naming it.

    Example::

        python_files(["train.py", "src/"])   # [Path('train.py'), Path('src/model.py'), ...]
    """
    if not paths:
        raise ValueError("no path given: pass the files or directories to check")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(f for f in path.rglob("*.py") if f.is_file() and not _skipped(f, path))
        elif path.exists():  # a FIFO, a device, a socket: reading it could block or never end
            raise ValueError(f"path {str(raw)!r} is not a regular file or a directory "
                             f"({_kind(path)}); pass Python source files or directories")
        else:
            raise ValueError(f"path {str(raw)!r} does not exist (looked for {str(path.resolve())!r})")
    return files


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
