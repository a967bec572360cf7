"""`dspark check` parses a file a run of top-level statements at a time ([Note: chunked parse]) and
finds exactly what a parse of the whole file finds, at the same lines and columns."""

from __future__ import annotations

import ast

import pytest

from dspark.check import chunked_parse
from dspark.check.chunked_parse import parser_text, runs, statements_by_depth
from dspark.check.placement_rules import Finding, check_source
from dspark.check.tree_walk import child_nodes, walk

# Findings in many top-level statements, each depending on what other statements (before or after
# it) define: imports and the engine's count come late, names bound early reach calls far below.
# Cuts that must not split: a string and a bracket with lines at column 0, a decorator, if/else,
# try/except/finally.
SOURCE = '''\
"""A training script.
x = dspark.distribute_tensor(t, shard_dim=None)
"""
opts = {"shard_dim": None}
dim = None
shard = 0 if fix else ds.REPLICATE
rows = [
1, 2,
]
ds.distribute_tensor(w, shard_dim=dim)
ds.distribute_batch(inputs, **opts)


@functools.cache
def split(batch, d=None):
    return ds.distribute_batch(batch, shard_dim=d)


if cfg:
    dim = 0
else:
    pass
b = ds.distribute_batch(batch, shard_dim=shard)
try:
    loss = loss / k
except ValueError:
    raise
finally:
    cleanup()
trainer.backward(loss)
ds.distribute_tensor(w, shard_dim=dim)  # dspark: ignore[DSP004]
loader = DataLoader(data, batch_size=8)
dt(x_batch, mesh, [Replicate()])
trainer = ds.Engine(model, grad_accum_steps=k)
import dspark as ds
from torch.utils.data import DataLoader
from torch.distributed.tensor import Replicate, distribute_tensor as dt
import functools
'''


def _whole_file(source: str, monkeypatch: pytest.MonkeyPatch, path: str = "train.py") -> list[Finding]:
    monkeypatch.setattr(chunked_parse, "RUN_CHARS", 10 * len(source))
    findings = check_source(source, path)
    monkeypatch.undo()
    return findings


@pytest.mark.parametrize("run_chars", [1, 30, 200])
def test_runs_find_what_the_whole_file_finds(run_chars: int, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _whole_file(SOURCE, monkeypatch)
    assert [(f.line, f.col, f.code) for f in whole] == [
        (10, 35, "DSP004"), (11, 1, "DSP001"), (16, 49, "DSP004"), (23, 42, "DSP006"),
        (25, 19, "DSP008"), (32, 10, "DSP007"), (33, 1, "DSP006")]
    monkeypatch.setattr(chunked_parse, "RUN_CHARS", run_chars)
    monkeypatch.setattr(chunked_parse, "KEPT_CHARS", 5 * run_chars)   # the later runs parsed twice
    assert len(list(runs(SOURCE, "train.py"))) > 3
    assert check_source(SOURCE, "train.py") == whole


def test_windows_line_ends_keep_the_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    source = SOURCE.replace("\n", "\r\n")
    monkeypatch.setattr(chunked_parse, "RUN_CHARS", 1)
    assert check_source(source, "train.py") == _whole_file(SOURCE, monkeypatch)


def test_a_syntax_error_far_down_is_the_whole_files_error(monkeypatch: pytest.MonkeyPatch) -> None:
    source = "import dspark\n" + "x = 1\n" * 500 + "def broken(:\n" + "y = 2\n" * 500
    monkeypatch.setattr(chunked_parse, "RUN_CHARS", 100)
    findings = check_source(source, "broken.py")
    assert [(f.code, f.line, f.col) for f in findings] == [("DSP000", 502, 12)]
    assert findings == _whole_file(source, monkeypatch, "broken.py")


def test_each_run_is_parsed_alone_with_the_files_line_numbers() -> None:
    parsed = list(runs(SOURCE, "train.py", run_chars=1))
    # a cut never splits a statement: the runs' statements are the whole file's
    whole = ast.parse(SOURCE)
    assert [ast.dump(s, include_attributes=True) for _run, tree in parsed for s in tree.body] == [
        ast.dump(s, include_attributes=True) for s in whole.body]
    assert "".join(SOURCE[run.start:run.end] for run, _tree in parsed) == SOURCE
    # cuts only where a statement starts (its decorators included): the string, the bracket, the
    # decorator and the if/else, try/finally statements stay whole
    starts = {min([s.lineno, *(d.lineno for d in getattr(s, "decorator_list", []))]) for s in whole.body}
    assert len(parsed) >= 10
    assert all(run.first_line in starts for run, _tree in parsed), [run.first_line for run, _tree in parsed]


def test_a_large_file_is_never_parsed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    block = "dim = None\nif dim is None:\n    dim = 0\nx = dspark.distribute_tensor(t, shard_dim=dim)\n"
    source = "import dspark\n" + block * 2000   # about 160 KB
    parsed: list[int] = []
    real_parse = ast.parse

    def parse(text: str, *args: object, **kwargs: object) -> ast.AST:
        parsed.append(len(text.lstrip("\n")))
        return real_parse(text, *args, **kwargs)   # type: ignore[arg-type]

    monkeypatch.setattr(chunked_parse.ast, "parse", parse)
    monkeypatch.setattr(chunked_parse, "RUN_CHARS", 10_000)
    monkeypatch.setattr(chunked_parse, "KEPT_CHARS", 40_000)
    assert check_source(source, "big.py") == []
    runs_count = len(source) // 11_000
    assert len(parsed) >= 2 * runs_count - 4   # the runs after the first 40 KB twice: two walks
    assert max(parsed) < 11_000


def test_statements_come_in_ast_walk_order() -> None:
    tree = ast.parse(SOURCE)
    assert [node for _depth, node in statements_by_depth(tree)] == [
        node for node in ast.walk(tree) if isinstance(node, ast.stmt)]


def test_the_walks_are_asts_walks_less_the_tokens() -> None:
    tokens = (ast.expr_context, ast.operator, ast.unaryop, ast.cmpop, ast.boolop)
    tree = ast.parse(SOURCE + "match x:\n    case {'a': 1, **rest} if not a < b:\n        global g\n"
                     "async def f(*a, k=1, **kw) -> int:\n    nonlocal_ = [i async for i in a if -i]\n"
                     "    return f'{x!r:>{w}}', (y := x[1:2]), {**kw}, lambda: (yield), a and b\n")
    assert list(walk(tree)) == [node for node in ast.walk(tree) if not isinstance(node, tokens)]
    assert all(child_nodes(node) == [c for c in ast.iter_child_nodes(node) if not isinstance(c, tokens)]
               for node in ast.walk(tree))


def test_parser_text_counts_lines_as_the_parser_does() -> None:
    assert parser_text("a\r\nb\rc\n") == "a\nb\nc\n"
    assert ast.parse("a\r\nb\rc\n").body[2].lineno == 3


def test_an_engine_keyword_spelled_in_other_letters_is_still_read() -> None:
    source = ("import dspark\ntrainer = dspark.Engine(m, \uff47rad_accum_steps=k)\n"
              "loss = loss / k\ntrainer.backward(loss)\n")   # Python reads the fullwidth g as g
    assert [(f.code, f.line) for f in check_source(source, "train.py")] == [("DSP008", 3)]
