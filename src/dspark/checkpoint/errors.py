"""What can go wrong with a checkpoint, by kind: a path with no checkpoint, a checkpoint that does
not fit (another model, a partial or damaged directory), and a save that failed on some rank."""

from __future__ import annotations

from dspark.errors import DSparkError

__all__ = ["CheckpointError", "CheckpointIntegrityError", "CheckpointNotFoundError", "CheckpointSaveError",
           "first_line"]


class CheckpointError(DSparkError, ValueError):
    """A checkpoint that cannot be loaded into this engine: another model (a parameter's name or
    shape differs), or a partial or damaged directory. The message names what differs."""


class CheckpointIntegrityError(CheckpointError):
    """A file of a checkpoint is not the one its save wrote: copied or linked from another
    checkpoint, edited, or damaged since (see [Note: checkpoint integrity] in
    :mod:`dspark.checkpoint.manifest`). The message names the file."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the path (nothing there, or a directory that is not a DSpark checkpoint)."""


class CheckpointSaveError(DSparkError, RuntimeError):
    """A save failed on at least one rank; the message names the ranks and their errors. The
    checkpoint previously at the path, if any, is untouched and no partial directory is left."""

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        """The ranks where the save failed (every rank raises, not only those)."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of ``exc``'s message, cut at ``limit`` characters: PyTorch's errors can be
    pages long (``weights_only`` explains itself at length), a checkpoint error names the file.

    Example::

        first_line(ValueError("bad\nmore"))   # 'bad'
    """
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else ""
