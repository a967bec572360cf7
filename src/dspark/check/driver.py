"""``dspark check`` over many files: each file is read and checked on its own, and one that cannot be
read or analysed is a finding on that file, never the end of the run.

[Note: one file never ends the run] The rules walk syntax trees recursively, and a valid file can
nest deeper than Python's default recursion limit: a 500-term ``a + a + ...`` is a tree 500 deep,
which CPython compiles but which ended a whole directory's check with a ``RecursionError``
traceback, the other files' findings never printed. The analysis of each file runs with a deeper
limit (:data:`ANALYSIS_RECURSION_LIMIT`, enough for thousands of levels: the checker's recursion
stays in Python frames, which since Python 3.11 use no C stack), and what still fails for one file
(a nesting deeper than that, a parser that gives up on it, a NUL byte, an error inside a rule) is a
``DSP000`` finding naming the file and the reason; the other files are checked as usual. A path
given that cannot be reached (a symbolic link loop, no permission, a missing directory) is refused
by name before anything is read (:func:`dspark.check.source_files.python_files`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from dspark.check.placement_rules import Finding, check_source
from dspark.check.source_files import python_files

__all__ = ["ANALYSIS_RECURSION_LIMIT", "check_paths"]

ANALYSIS_RECURSION_LIMIT = 20_000
"""Python's recursion limit while one file is analysed (see [Note: one file never ends the run])."""


def check_paths(paths: Sequence[str | Path]) -> tuple[list[Finding], int]:
    """The findings in every file under ``paths``, and how many files were checked. A file that
    cannot be read or analysed is one ``DSP000`` finding with the reason; ``ValueError`` naming a
    path that cannot be reached.

    Example::

        findings, num_files = check_paths(["examples/"])
    """
    files = python_files(paths)
    findings: list[Finding] = []
    for file in files:
        findings += check_file(file)
    return findings, len(files)


def check_file(file: Path) -> list[Finding]:
    """The findings in one file, or one ``DSP000`` finding saying why it could not be checked.

    Example::

        check_file(Path("train.py"))   # [Finding(path='train.py', line=3, ..., code='DSP001', ...)]
    """
    try:
        source = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [_not_checked(file, f"cannot read: {exc}")]
    try:
        with _recursion_limit(ANALYSIS_RECURSION_LIMIT):
            return check_source(source, str(file))
    except RecursionError:
        return [_not_checked(file, f"cannot analyse: its code nests deeper than the checker follows "
                                   f"(Python's recursion limit, {ANALYSIS_RECURSION_LIMIT}); the other "
                                   "rules did not run on this file")]
    except MemoryError:  # CPython's parser gives up on a nesting too deep for its own stack
        return [_not_checked(file, "cannot parse: the code is too deeply nested for Python's parser")]
    except ValueError as exc:  # a NUL byte, which the parser refuses outright
        return [_not_checked(file, f"cannot parse: {exc}")]
    except Exception as exc:  # a bug in a rule: this file unchecked, said so, the others checked
        return [_not_checked(file, f"cannot analyse: the checker failed on this file "
                                   f"({type(exc).__name__}: {str(exc)[:200]}); please report it")]


def _not_checked(file: Path, why: str) -> Finding:
    return Finding(path=str(file), line=1, col=1, code="DSP000", message=why)


@contextlib.contextmanager
def _recursion_limit(limit: int) -> Iterator[None]:
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)
