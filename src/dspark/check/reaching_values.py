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
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

__all__ = ["Values", "reaching_values"]

Binding = tuple[ast.expr | None, int]
Values = dict[str, list[Binding]]
"""name -> the (expression, line) it may hold; an expression None is unknown."""

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_EXITS = (ast.Raise, ast.Return, ast.Continue, ast.Break)


def _merge(*states: Values | None) -> Values | None:
    """What holds after any of ``states`` (None: a path that never gets here)."""
    live = [s for s in states if s is not None]
    if not live:
        return None
    out: Values = {}
    for state in live:
        for name, values in state.items():
            have = out.setdefault(name, [])
            have.extend(v for v in values if v not in have)
    return out


def _is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _narrow(state: Values, test: ast.expr, *, true: bool) -> Values:
    """``state`` where ``test`` evaluated to ``true``: ``x is None`` keeps x's None values (and
    unknowns) only, ``x is not None`` drops them, a truthy ``x`` drops them, a falsy one keeps all
    (0 is falsy too)."""
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
        return state
    if name not in state or effect == "keep":
        return state
    values = state[name]
    if effect == "only_none":
        narrowed = [v for v in values if v[0] is None or _is_none(v[0])]
    else:
        narrowed = [v for v in values if not _is_none(v[0])]
    return {**state, name: narrowed}


class _Flow:
    def __init__(self) -> None:
        self.at_call: dict[int, Values] = {}

    def record(self, stmt: ast.AST, state: Values) -> None:
        """Every call in ``stmt`` outside nested statements and scopes sees ``state``."""
        stack: list[ast.AST] = [stmt]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Call):   # a loop's body runs twice here: both rounds count
                self.at_call[id(node)] = _merge(self.at_call.get(id(node)), state) or state
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (ast.stmt, *_SCOPES)):
                    stack.append(child)

    def block(self, body: Iterable[ast.stmt], state: Values | None) -> Values | None:
        for stmt in body:
            if state is None:  # after a raise / return: nothing runs here on this path
                return None
            state = self.statement(stmt, state)
        return state

    def statement(self, stmt: ast.stmt, state: Values) -> Values | None:
        self.record(stmt, state)
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                state = _bind(state, target, stmt.value, stmt.lineno)
            return state
        if isinstance(stmt, ast.AnnAssign):
            return state if stmt.value is None else _bind(state, stmt.target, stmt.value, stmt.lineno)
        if isinstance(stmt, ast.AugAssign):
            return _bind(state, stmt.target, None, stmt.lineno)
        if isinstance(stmt, ast.If):
            after_body = self.block(stmt.body, _narrow(state, stmt.test, true=True))
            after_else = self.block(stmt.orelse, _narrow(state, stmt.test, true=False))
            return _merge(after_body, after_else)
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
            start = state if not isinstance(stmt, (ast.For, ast.AsyncFor)) else _bind(state, stmt.target, None, stmt.lineno)
            once = self.block(stmt.body, start)
            again = self.block(stmt.body, _merge(start, once) or start)   # values of a second round
            return _merge(state, once, again, self.block(stmt.orelse, _merge(state, once, again)))
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if item.optional_vars is not None:
                    state = _bind(state, item.optional_vars, None, stmt.lineno)
            return self.block(stmt.body, state)
        if isinstance(stmt, (ast.Try, ast.TryStar)):
            after_body = self.block(stmt.body, state)
            handlers = [self.block(h.body, _merge(state, after_body)) for h in stmt.handlers]
            done = _merge(self.block(stmt.orelse, after_body), *handlers)
            return self.block(stmt.finalbody, done) if stmt.finalbody else done
        if isinstance(stmt, ast.Match):
            cases = [self.block(case.body, state) for case in stmt.cases]
            return _merge(state, *cases)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return _bind(state, ast.Name(id=stmt.name), None, stmt.lineno)
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                state = _bind(state, ast.Name(id=(alias.asname or alias.name).split(".")[0]), None, stmt.lineno)
            return state
        if isinstance(stmt, _EXITS):
            return None
        # walrus targets inside an expression statement
        for node in ast.walk(stmt):
            if isinstance(node, ast.NamedExpr):
                state = _bind(state, node.target, node.value, stmt.lineno)
        return state


def _bind(state: Values, target: ast.expr, value: ast.expr | None, line: int) -> Values:
    """``state`` after ``target = value``: a plain name takes ``value``; every name in an
    unpacking, subscript-free target takes an unknown value."""
    if isinstance(target, ast.Name):
        return {**state, target.id: [(value, line)]}
    if isinstance(target, (ast.Tuple, ast.List, ast.Starred)):
        out = state
        for name in ast.walk(target):
            if isinstance(name, ast.Name):
                out = {**out, name.id: [(None, line)]}
        return out
    return state   # an attribute or subscript binds no name


def reaching_values(scope: ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                    | ast.ClassDef) -> dict[int, Values]:
    """For every call in ``scope`` (not in its nested functions or classes), keyed by ``id(call)``:
    the values each name of the scope may hold when the call runs.

    Example::

        tree = ast.parse("dim = None\\ndim = 0\\nf(dim)")
        call = tree.body[2].value
        reaching_values(tree)[id(call)]["dim"]   # [(<Constant 0>, 2)]
    """
    state: Values = {}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        args = scope.args
        positional = [*args.posonlyargs, *args.args]
        defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
        for arg, default in [*zip(positional, [*defaults, *args.defaults], strict=True),
                             *zip(args.kwonlyargs, args.kw_defaults, strict=True)]:
            state[arg.arg] = [(default, arg.lineno)]
        for extra in (args.vararg, args.kwarg):
            if extra is not None:
                state[extra.arg] = [(None, extra.lineno)]
    flow = _Flow()
    if isinstance(scope, ast.Lambda):
        flow.record(scope.body, state)
    else:
        flow.block(scope.body, state)
    return flow.at_call
