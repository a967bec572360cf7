"""DSpark's exception types, every package's in this one module. User-input errors subclass
ValueError/TypeError; distributed failures name the rank that saw them."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "DSparkError",
    "MissingExtraError",
    "NotInitializedError",
    "OtherRankError",
    "PlacementError",
    "ShardedGradError",
    "ShardedOptimizerStateError",
    "Zero3StateDictError",
    "first_line",
]


class DSparkError(Exception):
    """Base class of DSpark's own errors."""


class PlacementError(DSparkError, ValueError):
    """A placement that would split or replicate a tensor wrongly (e.g. ``shard_dim=None``)."""


class NotInitializedError(DSparkError, RuntimeError):
    """A distributed call was made before :func:`dspark.init`."""


class CollectiveError(DSparkError, RuntimeError):
    """A collective failed on this rank; the message starts with ``rank R:``."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the group's timeout (a rank never joined). The message
    names the collective, its bytes, its label and the engine step it was part of, the timeout, and
    the ranks that never joined."""

    def __init__(self, message: str, *, missing_ranks: tuple[int, ...] | None = None) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        """The ranks that never joined, where the transport can tell (None where it cannot)."""


class OtherRankError(DSparkError, RuntimeError):
    """Another rank failed at a step every rank takes together; this rank stops too instead of waiting
    for it in a collective. The message names the failed ranks and the first error."""

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        """The ranks where the step failed."""


class ShardedGradError(DSparkError, RuntimeError):
    """A module parameter's gradient was read or changed under ``strategy="zero2"`` or ``"zero3"``,
    where each rank holds only its rows of each gradient, inside the engine (a
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` kept from DDP would clip nothing). The
    message names ``Engine(clip_grad_norm=c)`` and ``engine.clip_grad_norm_(c)``."""


class ShardedOptimizerStateError(DSparkError, RuntimeError):
    """``optimizer.state_dict()`` or ``load_state_dict()`` of an optimizer sharded by zero1, zero2 or
    zero3 on several ranks: it holds only this rank's rows, so a saved state dict would be part of the
    state. The message names ``engine.save()`` / ``engine.load()``."""


class Zero3StateDictError(DSparkError, RuntimeError):
    """``state_dict()`` or ``load_state_dict()`` on a module trained with ``strategy="zero3"`` while its
    parameters are freed (between steps): it would save or compare empty tensors. The message names
    ``engine.full_state_dict()``, ``engine.save()`` and ``engine.load_full_state_dict()``."""


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


class MissingExtraError(DSparkError, ImportError):
    """A feature needs a package that only one of DSpark's extras installs (the benchmark lab's
    figures need matplotlib: ``pip install 'dspark[lab]'``). The message names the feature, the
    package and the install; the command line prints it as one line.

    Example::

        raise MissingExtraError("matplotlib", extra="lab", needed_for="the HTML report's figures")
    """

    def __init__(self, package: str, *, extra: str, needed_for: str) -> None:
        super().__init__(f"{package} (for {needed_for}) is not installed: pip install 'dspark[{extra}]'",
                         name=package)
        self.extra = extra
        """The extra that installs the package."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of ``exc``'s message, cut at ``limit`` characters: PyTorch's errors can be
    pages long (``weights_only`` explains itself at length), a checkpoint error names the file.

    Example::

        first_line(ValueError("bad\nmore"))   # 'bad'
    """
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else ""
