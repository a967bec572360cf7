"""Which values a name may hold where a call reads it: a small flow analysis of one scope, for
``dspark check``'s rules (:mod:`dspark.check.placement_rules`).

The statements of a scope run in order; each plain ``name = value`` replaces what the name held, an
``if`` / ``else`` keeps what either branch leaves, a loop what its body leaves or what it started
with, and a branch that ends in ``raise`` / ``return`` / ``continue`` / ``break`` leaves nothing
behind it. A test ``name is None`` (``is not None``, ``not name``, ``name``) narrows the name in each
branch, so the usual guard is understood::

    def split(batch, dim=None):
        if dim is None:
            dim = 0                                # after the if: only 0 reaches the call
        return dspark.distribute_batch(batch, shard_dim=dim)

What a name may hold is a list of (expression bound, line); the expression is None where it is not
known (a loop target, an unpacking, an augmented assignment, a parameter without a default). A name
never bound in the scope has no entry (a global or a closure: not followed).

[Note: linear flow] The analysis costs time and memory in proportion to the scope's size, however
many names it binds. A branch does not copy what every name holds: it is a :class:`_Names` layer
over the state it starts from, holding only the names it binds; where branches meet, only the names
they bound are merged, into the state they started from, so layers never pile up beyond the nesting
depth of the code. Each call keeps the values of the names it mentions, and no others (the rules
look up only those).

[Note: module flow by chunks] A large file is checked a run of top-level statements at a time, so
that only that run's syntax tree is alive (see [Note: chunked parse] in placement_rules.py). The
module's own flow then goes on from one run to the next (:class:`ModuleFlow`): the names bound so
far, with what they may hold, are all it carries over. The expressions they hold would keep parts of
every earlier run's tree alive; the caller says which of them its rules read (a ``None``, a
replicate, a literal mapping), and the others become stand-ins (:class:`Elided`, one per expression)
that no rule reports on, so the memory carried over stays small.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterable
from typing import cast

from dspark.check.tree_walk import child_nodes, walk

__all__ = ["Elided", "ModuleFlow", "Values", "reaching_values"]

Binding = tuple[ast.expr | None, int]
Values = dict[str, list[Binding]]
"""name -> the (expression, line) it may hold; an expression None is unknown."""

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_EXITS = (ast.Raise, ast.Return, ast.Continue, ast.Break)
# try/except* (ast.TryStar) exists from Python 3.11; on 3.10 no source can hold one
if sys.version_info >= (3, 11):
    _TRIES: tuple[type[ast.stmt], ...] = (ast.Try, ast.TryStar)
else:
    _TRIES = (ast.Try,)


class _Names:
    """What each name may hold on one path: the names bound on this path since it left ``parent``
    (``own``), over what ``parent`` holds. A value list is never changed in place, so a call may
    keep a reference to it."""

    __slots__ = ("own", "parent")

    def __init__(self, parent: _Names | None = None) -> None:
        self.parent = parent
        self.own: Values = {}

    def get(self, name: str) -> list[Binding] | None:
        layer: _Names | None = self
        while layer is not None:
            found = layer.own.get(name)
            if found is not None:
                return found
            layer = layer.parent
        return None

    def fork(self) -> _Names:
        """A path that starts here (a branch, a loop's body)."""
        return _Names(self)

    def bound_since(self, base: _Names) -> set[str]:
        """The names bound on this path since it left ``base`` (an ancestor, or itself)."""
        names: set[str] = set()
        layer: _Names | None = self
        while layer is not None and layer is not base:
            names.update(layer.own)
            layer = layer.parent
        if layer is None:
            raise AssertionError("a path merged into a state it did not start from")
        return names


def _union(*lists: list[Binding] | None) -> list[Binding]:
    out: list[Binding] = []
    for values in lists:
        for value in values or ():
            if value not in out:
                out.append(value)
    return out


def _merged(base: _Names, paths: Iterable[_Names | None]) -> Values | None:
    """What the names bound on any of ``paths`` (each ``base`` or a path that started from it; None:
    a path that never gets here) may hold after them; None when no path gets here."""
    live = [p for p in paths if p is not None]
    if not live:
        return None
    names: set[str] = set()
    for path in live:
        names |= path.bound_since(base)
    return {name: _union(*(path.get(name) for path in live)) for name in sorted(names)}


def _join(base: _Names, paths: Iterable[_Names | None]) -> _Names | None:
    """``base`` after any of ``paths`` (see :func:`_merged`), or None when no path gets here."""
    merged = _merged(base, paths)
    if merged is None:
        return None
    base.own.update(merged)
    return base


def _is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _narrowed(state: _Names, test: ast.expr, *, true: bool) -> _Names:
    """A path from ``state`` where ``test`` evaluated to ``true``: ``x is None`` keeps x's None
    values (and unknowns) only, ``x is not None`` drops them, a truthy ``x`` drops them, a falsy one
    keeps all (0 is falsy too)."""
    path = state.fork()
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name)
            and _is_none(test.comparators[0]) and isinstance(test.ops[0], (ast.Is, ast.IsNot, ast.Eq, ast.NotEq))):
        name = test.left.id
        means_none = isinstance(test.ops[0], (ast.Is, ast.Eq)) == true
        effect = "only_none" if means_none else "drop_none"
    elif isinstance(test, ast.Name):
        name, effect = test.id, "drop_none" if true else "keep"
    elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name):
        name, effect = test.operand.id, "keep" if true else "drop_none"
    else:
        return path
    values = state.get(name)
    if values is None or effect == "keep":
        return path
    if effect == "only_none":
        path.own[name] = [v for v in values if v[0] is None or _is_none(v[0])]
    else:
        path.own[name] = [v for v in values if not _is_none(v[0])]
    return path


def _names_read(call: ast.Call) -> set[str]:
    return {node.id for node in walk(call) if isinstance(node, ast.Name)}


class _Flow:
    def __init__(self) -> None:
        self.at_call: dict[int, Values] = {}

    def record(self, stmt: ast.AST, state: _Names) -> None:
        """Every call in ``stmt`` outside nested statements and scopes sees ``state`` (for the
        names it mentions)."""
        stack: list[ast.AST] = [stmt]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Call):   # a loop's body runs twice here: both rounds count
                seen = self.at_call.setdefault(id(node), {})
                for name in _names_read(node):
                    values = state.get(name)
                    if values is not None:
                        seen[name] = _union(seen.get(name), values) if name in seen else values
            for child in child_nodes(node):
                if not isinstance(child, (ast.stmt, *_SCOPES)):
                    stack.append(child)

    def block(self, body: Iterable[ast.stmt], state: _Names | None) -> _Names | None:
        for stmt in body:
            if state is None:  # after a raise / return: nothing runs here on this path
                return None
            state = self.statement(stmt, state)
        return state

    def statement(self, stmt: ast.stmt, state: _Names) -> _Names | None:
        """``state`` after ``stmt`` (changed in place), or None when no path goes on after it."""
        self.record(stmt, state)
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                _bind(state, target, stmt.value, stmt.lineno)
        elif isinstance(stmt, ast.AnnAssign):
            if stmt.value is not None:
                _bind(state, stmt.target, stmt.value, stmt.lineno)
        elif isinstance(stmt, ast.AugAssign):
            _bind(state, stmt.target, None, stmt.lineno)
        elif isinstance(stmt, ast.If):
            after_body = self.block(stmt.body, _narrowed(state, stmt.test, true=True))
            after_else = self.block(stmt.orelse, _narrowed(state, stmt.test, true=False))
            return _join(state, [after_body, after_else])
        elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            return self.loop(stmt, state)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if item.optional_vars is not None:
                    _bind(state, item.optional_vars, None, stmt.lineno)
            return self.block(stmt.body, state)
        elif isinstance(stmt, _TRIES):
            return self.try_(cast(ast.Try, stmt), state)  # try/except* has try/except's fields
        elif isinstance(stmt, ast.Match):
            return _join(state, [state, *(self.block(case.body, state.fork()) for case in stmt.cases)])
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            _bind(state, ast.Name(id=stmt.name), None, stmt.lineno)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                _bind(state, ast.Name(id=(alias.asname or alias.name).split(".")[0]), None, stmt.lineno)
        elif isinstance(stmt, _EXITS):
            return None
        else:   # walrus targets inside an expression statement
            for node in walk(stmt):
                if isinstance(node, ast.NamedExpr):
                    _bind(state, node.target, node.value, stmt.lineno)
        return state

    def loop(self, stmt: ast.For | ast.AsyncFor | ast.While, state: _Names) -> _Names:
        """What either round of the body leaves, or what the loop started with (the body may not
        run), then the ``else``."""
        rounds = state.fork()
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            _bind(rounds, stmt.target, None, stmt.lineno)
        once = self.block(stmt.body, rounds.fork())
        if once is not None:
            second = rounds.fork()   # the values of a second round: what the first left, or its start
            second.own.update(_merged(rounds, [rounds, once]) or {})
            _join(state, [state, once, self.block(stmt.body, second.fork())])
        return _join(state, [state, self.block(stmt.orelse, state.fork())]) or state

    def try_(self, stmt: ast.Try, state: _Names) -> _Names | None:
        after_body = self.block(stmt.body, state.fork())
        handlers = []
        for handler in stmt.handlers:   # an exception may come before or after the body's bindings
            start = state.fork()
            start.own.update(_merged(state, [state, after_body]) or {})
            handlers.append(self.block(handler.body, start))
        after_else = self.block(stmt.orelse, after_body)
        done = _join(state, [after_else, *handlers])
        return self.block(stmt.finalbody, done) if stmt.finalbody else done


def _bind(state: _Names, target: ast.expr, value: ast.expr | None, line: int) -> None:
    """``target = value`` on this path: a plain name takes ``value``; every name in an unpacking,
    subscript-free target takes an unknown value; an attribute or subscript binds no name."""
    if isinstance(target, ast.Name):
        state.own[target.id] = [(value, line)]
    elif isinstance(target, (ast.Tuple, ast.List, ast.Starred)):
        for name in walk(target):
            if isinstance(name, ast.Name):
                state.own[name.id] = [(None, line)]


def reaching_values(scope: ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                    | ast.ClassDef) -> dict[int, Values]:
    """For every call in ``scope`` (not in its nested functions or classes), keyed by ``id(call)``:
    the values each name the call mentions may hold when the call runs. Linear in the scope's size
    (see [Note: linear flow]).

    Example::

        tree = ast.parse("dim = None\\ndim = 0\\nf(dim)")
        call = tree.body[2].value
        reaching_values(tree)[id(call)]["dim"]   # [(<Constant 0>, 2)]
    """
    state = _Names()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = scope.args
        positional = [*args.posonlyargs, *args.args]
        defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
        for arg, default in [*zip(positional, [*defaults, *args.defaults], strict=True),
                             *zip(args.kwonlyargs, args.kw_defaults, strict=True)]:
            state.own[arg.arg] = [(default, arg.lineno)]
        for extra in (args.vararg, args.kwarg):
            if extra is not None:
                state.own[extra.arg] = [(None, extra.lineno)]
    flow = _Flow()
    if isinstance(scope, ast.Lambda):
        flow.record(scope.body, state)
    else:
        flow.block(scope.body, state)
    return flow.at_call


class Elided(ast.Constant):
    """A bound expression that no rule reads, kept as ``...`` where a later run of the module looks
    its name up (see [Note: module flow by chunks])."""

    def __init__(self) -> None:
        super().__init__(value=...)


class ModuleFlow:
    """The module scope's reaching values, fed one run of top-level statements at a time, in order
    (see [Note: module flow by chunks]); the same values :func:`reaching_values` gives for the
    module, as long as ``read`` keeps every expression a rule looks at.

    Example::

        flow = ModuleFlow(read=lambda expr: isinstance(expr, ast.Constant))
        flow.run(ast.parse("dim = None\\n").body)
        at_call = flow.run(ast.parse("\\nf(dim)").body)   # {id(call): {"dim": [(<None>, 1)]}}
    """

    def __init__(self, *, read: Callable[[ast.expr], bool]) -> None:
        self._read = read
        self._flow = _Flow()
        self._names: _Names | None = _Names()   # None: a top-level raise / return ended the module

    def run(self, body: Iterable[ast.stmt]) -> dict[int, Values]:
        """What each call in ``body`` (the next top-level statements) sees, keyed by ``id(call)``."""
        self._flow.at_call = {}
        if self._names is not None:
            run = self._flow.block(body, self._names.fork())   # this run's names, on their own layer
            self._names = None if run is None else self._carried(run)
        return self._flow.at_call

    def _carried(self, run: _Names) -> _Names:
        """The names after ``run``, folded into its parent, each expression no rule reads elided."""
        names = run.parent
        if names is None:
            raise AssertionError("a run of the module is a layer over the names before it")
        stand_ins: dict[int, ast.expr] = {}

        def carried(expr: ast.expr | None) -> ast.expr | None:
            if expr is None or isinstance(expr, Elided) or self._read(expr):
                return expr
            return stand_ins.setdefault(id(expr), Elided())

        for name, values in run.own.items():
            names.own[name] = [(carried(expr), line) for expr, line in values]
        return names
