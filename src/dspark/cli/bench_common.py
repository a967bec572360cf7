"""What every ``dspark bench`` action shares: the console, the ledger's path, output checks.

Example::

    console().print("done")
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from dspark.cli.whole_file import write_whole

__all__ = ["EXIT_FAILED", "check_outputs", "console", "db_path", "describe", "write_json"]

EXIT_FAILED = 1
# Rich assumes 80 columns when stdout is not a terminal (`make bench | tee`, CI logs), which
# squeezes the results table into unreadable cells.
_PIPE_WIDTH = 180


def console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr), :data:`_PIPE_WIDTH` wide when it is not a terminal."""
    made = Console(stderr=stderr)
    return made if made.is_terminal else Console(stderr=stderr, width=_PIPE_WIDTH)


def check_outputs(args: argparse.Namespace) -> None:
    """``--json PATH``'s folder, ``--report DIR`` and ``--trace DIR`` must be writable places, not
    files: ``ValueError`` naming the option and the path. ``--report`` also needs the lab's extra
    (matplotlib draws its figures): :class:`MissingExtraError` before anything is measured."""
    if getattr(args, "report", None) is not None:
        import dspark.bench.present.plots  # noqa: F401  (raises MissingExtraError without matplotlib)
    for option, path, is_dir in (("--json", getattr(args, "json", None), False),
                                 ("--report", getattr(args, "report", None), True),
                                 ("--trace", getattr(args, "trace", None), True)):
        if path is None:
            continue
        if is_dir and path.exists() and not path.is_dir():
            raise ValueError(f"{option} {str(path)!r} is a file; give a directory (it is created if needed)")
        if not is_dir and path.is_dir():
            raise ValueError(f"{option} {str(path)!r} is a directory; give a file path")
        above = next((p for p in (path if is_dir else path.parent, *path.parents)
                      if p.exists()), None)
        if above is not None and not above.is_dir():
            raise ValueError(f"{option} {str(path)!r}: {str(above)!r} is a file, not a directory")
        if above is not None and not os.access(above, os.W_OK | os.X_OK):
            raise PermissionError(f"{option} {str(path)!r}: {str(above)!r} is not writable")
        try:  # the folder now, as the write would later: a place no one can write fails here
            (path if is_dir else path.parent).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"{option} {str(path)!r}: cannot create its folder: {exc}") from None


def write_json(path: Path, rows: object) -> None:
    """Write ``rows`` as JSON to ``path``, creating its folder as ``--report`` and ``--trace`` do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(rows, indent=2))


def describe(config: Any) -> str:
    from dspark.bench.measure.runner import describe_config

    return describe_config(config)


def db_path(args: argparse.Namespace) -> Path:
    from dspark.bench.ledger.ledger import default_db_path

    return Path(args.db) if args.db is not None else default_db_path()
