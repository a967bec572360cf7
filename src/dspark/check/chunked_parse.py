"""A module parsed a run of top-level statements at a time, for ``dspark check``.

[Note: chunked parse] CPython's syntax tree of a file takes some hundred times the file's size
(``benchmarks/check_scaling.py``: docs/figures.md#check-scaling), so ``dspark check`` never holds a
large file's whole tree: it cuts the source
at top-level statements into runs of about ``RUN_CHARS`` characters and parses each run alone,
after as many blank lines as come before it, so that every line and column is the whole file's.
A cut goes before a line that starts at column 0 with neither a blank, a comment, nor ``else`` /
``elif`` / ``except`` / ``finally`` (which continue the statement above). Such a line may still
sit inside a string or a bracket, or follow a decorator: the run before it then fails to parse,
and is retried up to a later cut (twice as far each time). A run that parses ends where the
tokenizer is outside any string, bracket or statement, so the next line starts a statement of its
own and every run's tree is the one the whole file's parse would hold for those statements. A
file that does not parse is parsed whole, once, for the error the whole file gives.

The rules read each run and drop it (the checker walks the runs twice: once for what the whole
module defines, its imports and accumulation counts, then for the findings; the trees of a file's
first ``KEPT_CHARS`` characters are kept from one walk to the next, so most files are parsed
once); what one run's rules need from the runs before it is carried over small (see [Note: module flow by chunks] in
reaching_values.py).

[Note: no cyclic collection while checking] Python's cyclic garbage collector runs every few
hundred allocations and, every so often, scans every live object; a run's tree is hundreds of
thousands of new objects, and the names carried over keep growing with the file, so the scans were
almost half the time of a large file. The checker builds no reference cycles (a tree points down
only; what it drops, reference counting frees), so :func:`collector_paused` pauses the collector
while a file is checked, and resumes it as it was.
"""

from __future__ import annotations

import ast
import gc
import re
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["KEPT_CHARS", "RUN_CHARS", "Run", "collector_paused", "parse_run", "parser_text", "runs", "second_walk",
           "statements_by_depth", "tree_kept"]

RUN_CHARS = 100_000
"""About how many characters of source each run holds: a run's syntax tree stays small, and there
are few enough runs that cutting costs nothing next to parsing."""
KEPT_CHARS = 4 * RUN_CHARS
"""A file's runs within this many characters from its start keep their tree from the checker's
first walk to its second (four runs' trees at the most); the runs after them are parsed again."""
_BLOCK_ITEMS = (ast.stmt, ast.excepthandler, ast.match_case)   # what a block of statements holds
_CUT = re.compile(r"^(?!(?:else|elif|except|finally)\b)[^\s#]", re.MULTILINE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Top-level statements at ``text[start:end]``, starting at 1-based line ``first_line``."""

    start: int
    end: int
    first_line: int


def parser_text(source: str) -> str:
    """``source`` with the line ends the parser counts (``\\r\\n``, ``\\r``) written as ``\\n``."""
    return source.replace("\r\n", "\n").replace("\r", "\n") if "\r" in source else source


def parse_run(text: str, run: Run, path: str) -> ast.Module:
    """The syntax tree of ``run``, with the whole file's line numbers."""
    return ast.parse("\n" * (run.first_line - 1) + text[run.start:run.end], filename=path)


def runs(text: str, path: str, *, run_chars: int | None = None) -> Iterator[tuple[Run, ast.Module]]:
    """Each run of ``text`` (see [Note: chunked parse]) with its tree, in order. Raises
    ``SyntaxError`` when a run reaching the end of the file does not parse. ``run_chars``: the
    runs' size (:data:`RUN_CHARS` by default).

    Example::

        [run.first_line for run, _tree in runs("a = 1\\nb = 2\\n", "a.py", run_chars=1)]   # [1, 2]
    """
    start, first_line = 0, 1
    while start < len(text):
        reach = run_chars or RUN_CHARS
        while True:
            run = Run(start=start, end=_cut(text, start + reach), first_line=first_line)
            try:
                tree = parse_run(text, run, path)
                break
            except SyntaxError:
                if run.end == len(text):
                    raise
                reach *= 2
        yield run, tree
        first_line += text.count("\n", run.start, run.end)
        start = run.end


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside, as it was after (see [Note: no cyclic collection
    while checking])."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def tree_kept(run: Run, tree: ast.Module) -> ast.Module | None:
    """``tree`` when ``run`` lies within the first :data:`KEPT_CHARS` characters, else None."""
    return tree if run.end <= KEPT_CHARS else None


def second_walk(text: str, path: str, first: list[tuple[Run, ast.Module | None]]) -> Iterator[ast.Module]:
    """Each run's tree again, in order: the one ``first`` kept (let go of as it is handed out), or
    parsed anew."""
    for index, (run, tree) in enumerate(first):
        first[index] = (run, None)
        yield tree if tree is not None else parse_run(text, run, path)


def _cut(text: str, at: int) -> int:
    """The first place at or after ``at`` where a top-level statement may start (else the end)."""
    if at >= len(text):
        return len(text)
    found = _CUT.search(text, at)
    return len(text) if found is None else found.start()


def statements_by_depth(tree: ast.Module) -> Iterator[tuple[int, ast.stmt]]:
    """The statements among ``ast.walk(tree)``'s nodes, in its order (breadth first), each with its
    depth (``tree``: 0), without visiting a single expression. The whole module's walk visits depth
    by depth, each depth's nodes in source order, so sorting the runs' statements by depth, stably,
    gives the whole module's order.

    Example::

        [(d, type(s).__name__) for d, s in statements_by_depth(ast.parse("if a:\\n    b = 1\\n"))]
        # [(1, 'If'), (2, 'Assign')]
    """
    queue: deque[tuple[int, ast.AST]] = deque((1, stmt) for stmt in tree.body)
    while queue:
        depth, node = queue.popleft()
        if isinstance(node, ast.stmt):
            yield depth, node
        for field in node._fields:   # the blocks, in ast.iter_child_nodes' order
            value = getattr(node, field, None)
            if isinstance(value, list) and value and isinstance(value[0], _BLOCK_ITEMS):
                queue.extend((depth + 1, item) for item in value)
