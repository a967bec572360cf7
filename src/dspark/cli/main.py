"""The ``dspark`` command: ``env``, ``run``, ``bench``, ``check``, ``ckpt``.

The CLI is thin: it parses, then calls the library. Each subcommand lives in its own module of
``dspark.cli`` and exposes one function, the whole interface between it and this file::

    def add_parser(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("NAME", help="...", description="...")
        parser.add_argument(...)
        parser.set_defaults(func=run)       # run(args: argparse.Namespace) -> int (the exit code)

:func:`main` registers every module in :data:`COMMAND_MODULES`, parses, and returns
``args.func(args)``. Bad input is reported here, once, for every subcommand: a handler (or the
library below it) raises ``ValueError`` / ``TypeError`` / ``FileNotFoundError`` (DSpark's own
errors subclass these), and the user sees one line on stderr and exit code 2, no traceback.
Usage errors from argparse get the same treatment. Any other ``OSError`` (a full disk, an I/O
error) is one line and exit code 1. Anything else is a bug and keeps its traceback (``-vv`` logs
the traceback of the others too).

Exit codes: 0 success, 1 the command ran and found a failure (``check`` findings, a failed
job), 2 bad input, 130 interrupted; ``run`` returns the launcher's own code.

Example::

    from dspark.cli.main import main
    main(["check", "train.py"])   # 0 when clean
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from dspark._version import __version__
from dspark.errors import MissingExtraError

__all__ = ["COMMAND_MODULES", "UsageError", "build_parser", "main"]

COMMAND_MODULES = (
    "dspark.cli.env_cmd",
    "dspark.cli.run_cmd",
    "dspark.cli.bench_cmd",
    "dspark.cli.check_cmd",
    "dspark.cli.ckpt_cmd",
    "dspark.cli.plan_cmd",
)
"""Modules that each register one subcommand through ``add_parser(subparsers)``."""

_log = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A command line argparse rejected; its message is the one line the user sees."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and calls sys.exit(2) itself; raising instead lets
    # main() report every kind of bad input the same way and return instead of exiting.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``dspark`` parser with every subcommand registered, or with ``only`` that one (when it
    names one): ``dspark run`` then imports no other command's module, nor PyTorch (see [Note: a
    lazy package] in :mod:`dspark`).

    Example::

        build_parser().parse_args(["env", "--json"]).json   # True
    """
    parser = _Parser(prog="dspark", description="Data-parallel training on 1 to N devices that "
                     "scales, and proves that it scales.")
    parser.add_argument("--version", action="version", version=f"dspark {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: info, -vv: debug)")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    wanted = f"dspark.cli.{only}_cmd"
    for name in (wanted,) if wanted in COMMAND_MODULES else COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def _subcommand(args: Sequence[str]) -> str | None:
    """The subcommand ``args`` name: the first word that is not an option (``-v`` may come first)."""
    return next((arg for arg in args if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dspark`` command line and return its exit code.

    Example::

        raise SystemExit(main(["env", "--json"]))
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = "dspark"
    try:
        parser = build_parser(_subcommand(args_list))
        args = parser.parse_args(args_list)
        command = f"dspark {args.subcommand}"
        logging.basicConfig(level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
                            format="%(levelname)s %(name)s: %(message)s")
        return int(args.func(args))
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, NotADirectoryError,
            IsADirectoryError, PermissionError, MissingExtraError) as exc:  # bad input or install
        message = str(exc) if isinstance(exc, UsageError) else f"{command}: error: {exc}"
        _log.debug("bad input", exc_info=True)  # the traceback, for `dspark -vv ...`
        print(message.replace("\n", " "), file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # the system refused (a full disk, an I/O error): not a DSpark bug
        _log.debug("system error", exc_info=True)
        print(f"{command}: error: {exc}".replace("\n", " "), file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("dspark: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
