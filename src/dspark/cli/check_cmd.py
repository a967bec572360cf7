"""``dspark check PATH...``: find risky placements in user code without running it.

Prints ``path:line:col: CODE message`` per finding and a summary line. Exit code 1 when any
finding is an error, 0 otherwise (warnings alone pass), 2 when a path does not exist or is
neither a regular file nor a directory (a FIFO, ``/dev/zero``). The codes and their
fixes are documented in :mod:`dspark.check.placement_rules`.
"""

from __future__ import annotations

import argparse
import sys

from dspark.check.driver import check_paths
from dspark.check.placement_rules import CODES

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``dspark check``."""
    codes = "; ".join(f"{code} ({level}) {title}" for code, (level, title) in CODES.items())
    parser = subparsers.add_parser(
        "check", help="static check of user code for risky placements (shard_dim=None, ...)",
        description=f"Read Python files with ast (never importing them) and report risky "
                    f"placements. Codes: {codes}. Silence one with `# dspark: ignore[DSPnnn]` on its line.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or directories to check")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check the paths; print the findings and a summary."""
    findings, num_files = check_paths(args.paths)
    for finding in findings:
        sys.stdout.write(f"{finding}\n")
    errors = sum(f.severity == "error" for f in findings)
    warnings = len(findings) - errors
    files = f"{num_files} file{'s' if num_files != 1 else ''}"
    if findings:
        sys.stdout.write(f"{errors} error{'s' if errors != 1 else ''}, {warnings} "
                         f"warning{'s' if warnings != 1 else ''} in {files}\n")
    else:
        sys.stdout.write(f"no risky placements in {files}\n")
    return 1 if errors else 0
