"""DSP008: a loss divided by the gradient accumulation count before ``engine.backward``.

[Note: accumulation convention] ``dspark.Engine(grad_accum_steps=K)`` averages the window's K
micro-batches itself, inside ``engine.backward`` (as DeepSpeed, Accelerate and Lightning do): the
loss passed is the micro-batch's mean loss, as in a loop without accumulation. A loop ported from
plain PyTorch/DDP keeps ``loss = loss / gradient_accumulation_steps`` (nanoGPT's line), and the
gradients then come out K times too small: clipping is K times looser and AdamW's epsilon weighs K
times more, with no error anywhere. This rule finds that division before anything runs.

What counts as the accumulation count: a name or attribute whose last part contains ``accum``
(``gradient_accumulation_steps``, ``args.grad_accum_steps``, ``accum_iter``), the value passed as
``Engine(grad_accum_steps=...)``, ``EngineConfig(grad_accum_steps=...)`` or a config's
``.replace(grad_accum_steps=...)`` (a name, an attribute, or an int literal above 1), and any name
assigned from an expression that uses one of those (``k = cfg.accum // world_size``). A division
by it (``/``, ``/=``, ``.div(k)``, ``torch.div(x, k)``, in place ``loss.div_(k)``) or a product
with its reciprocal (``x * (1 / k)``, ``x * k ** -1``, ``x *= 1 / k``, ``loss.mul_(1.0 / k)``) that
reaches the argument of ``<engine>.backward(...)`` is reported at the division: directly in the
call, or through the names assigned (or changed in place) in the same scope before the call (each
name's latest assignment counts; an assignment that uses a divided name is divided too). A call of
a helper function of the module that returns such a division (``def scaled(l): return l / k``,
also through a parameter whose default is the count, ``def scaled(l, k=accum): ...``) divides as
well; helpers of at most ``HELPER_LINES`` lines are read (the checker keeps their trees from its
first walk to its second, and a helper is short). An engine is a name assigned from
``dspark.Engine(...)`` or any name or attribute whose last part contains ``engine``. Linear in the
file's size: the counts are collected in a few passes over the module's assignments, then each
scope's statements are walked once, in order.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator

from dspark.check.chunked_parse import statements_by_depth
from dspark.check.tree_walk import child_nodes, dotted_key, walk

__all__ = ["AccumulationCheck", "CountSources", "accumulation_findings"]

_ACCUM = re.compile(r"accum", re.IGNORECASE)
_ENGINE = re.compile(r"engine", re.IGNORECASE)
_DIV_METHODS = ("div", "div_", "divide", "true_divide")
_MUL_METHODS = ("mul", "mul_", "multiply")
_IN_PLACE = ("div_", "mul_", "true_divide_")
_PROPAGATION_PASSES = 3  # k = accum; j = k; i = j: chains longer than this are not followed
HELPER_LINES = 20
_FIX = ("the engine already averages the window's grad_accum_steps micro-batches (see the porting "
        "guide, docs/porting.md): drop the division and pass the micro-batch's mean loss, "
        "engine.backward(loss)")

Origin = Callable[[ast.expr], "str | None"]


def _leaf(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class CountSources:
    """What the module says about its accumulation counts and engines, gathered a run of top-level
    statements at a time (see [Note: chunked parse] in chunked_parse.py), in the order
    ``ast.walk`` over the whole module would meet it; :meth:`counts` then resolves it. Only
    what the counts need is kept of each run, not its tree."""

    def __init__(self) -> None:
        self._engine_kwargs: list[tuple[ast.expr, ast.expr]] = []   # (func, grad_accum_steps=...)
        self._engine_keys: set[str] = set()                # e = pkg.Engine(...): "e"
        self._helpers: list[ast.FunctionDef | ast.AsyncFunctionDef] = []   # short functions that may divide
        self._called_names: dict[str, set[str]] = {}       # e = Name(...): Name -> {"e"}
        # (depth, target keys, any read named *accum*, the keys read, the int literals read)
        self._assigns: list[tuple[int, tuple[str, ...], bool, tuple[str, ...], tuple[int, ...]]] = []

    def add(self, tree: ast.Module, source: str | None = None) -> None:
        """Note the next run of the module's top-level statements (whose text is ``source``, when
        known: the run's expressions are walked only when it names ``grad_accum_steps``, or may
        spell it in other letters that Python reads as the same name: NFKC, as in ``ｇrad``)."""
        if source is None or "grad_accum_steps" in source or not source.isascii():
            self._engine_kwargs += [(node.func, kw.value) for node in walk(tree) if isinstance(node, ast.Call)
                                    for kw in node.keywords if kw.arg == "grad_accum_steps"]
        for depth, node in statements_by_depth(tree):
            if isinstance(node, ast.Assign):
                self._note_assign(depth, node.targets, node.value)
                if isinstance(node.value, ast.Call):
                    func, targets = node.value.func, [k for t in node.targets if (k := dotted_key(t)) is not None]
                    if isinstance(func, ast.Name):   # what it names depends on the imports
                        self._called_names.setdefault(func.id, set()).update(targets)
                    elif isinstance(func, ast.Attribute) and func.attr.endswith("Engine") and dotted_key(func):
                        self._engine_keys.update(targets)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                self._note_assign(depth, [node.target], node.value)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _may_divide(node):
                self._helpers.append(node)

    def _note_assign(self, depth: int, targets: list[ast.expr], value: ast.expr) -> None:
        keys = tuple(k for t in targets for k in _target_keys(t))
        reads = [sub for sub in walk(value) if isinstance(sub, (ast.Name, ast.Attribute, ast.Constant))]
        accum = any((leaf := _leaf(sub)) is not None and _ACCUM.search(leaf) is not None for sub in reads)
        read_keys = tuple(k for sub in reads if (k := dotted_key(sub)) is not None)
        ints = tuple(sub.value for sub in reads if isinstance(sub, ast.Constant) and type(sub.value) is int)
        if keys and (accum or read_keys or ints):   # else it can never make a count
            self._assigns.append((depth, keys, accum, read_keys, ints))

    def counts(self, origin: Origin) -> _Counts:
        """The counts and engines, once every run was added; ``origin`` maps a function to its
        dotted import origin."""
        counts = _Counts()
        for func, value in self._engine_kwargs:   # the engine's count, given to it or to its config
            replaced = isinstance(func, ast.Attribute) and func.attr == "replace"
            if replaced or (origin(func) or "").split(".")[-1] in ("Engine", "EngineConfig"):
                counts.note_engine_value(value)
        counts.engines.update(self._engine_keys)
        for name, targets in self._called_names.items():
            if (origin(ast.Name(id=name)) or "").endswith("Engine"):
                counts.engines.update(targets)
        # the counts spread through the assignments, in the whole module's walk order
        assigns = sorted(self._assigns, key=lambda assign: assign[0])
        for _ in range(_PROPAGATION_PASSES):
            before = len(counts.keys)
            for _depth, keys, accum, read_keys, ints in assigns:
                if accum or any(k in counts.keys for k in read_keys) or any(i in counts.literals for i in ints):
                    counts.keys.update(keys)
            if len(counts.keys) == before:
                break
        for helper in self._helpers:   # after the counts: a helper divides by one of them
            where = _returned_division(helper, counts, origin)
            if where is not None:
                counts.helpers[helper.name] = (f"{helper.name}() at line {helper.lineno} returns its argument "
                                               f"divided by {_shown(where)}")
        return counts


class _Counts:
    """What holds the accumulation count in this module (see the module docstring)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.literals: set[int] = set()
        self.engines: set[str] = set()
        self.helpers: dict[str, str] = {}
        """A helper function that divides its argument by a count -> what it does, for the message."""

    def with_keys(self, keys: set[str]) -> _Counts:
        """These counts, plus ``keys`` (a helper's parameters whose default is a count)."""
        inner = _Counts()
        inner.keys, inner.literals, inner.engines, inner.helpers = (self.keys | keys, self.literals, self.engines,
                                                                    self.helpers)
        return inner

    def note_engine_value(self, value: ast.expr) -> None:
        if isinstance(value, ast.Constant) and isinstance(value.value, int) and value.value > 1:
            self.literals.add(value.value)
        elif (key := dotted_key(value)) is not None:
            self.keys.add(key)

    def is_count(self, node: ast.expr) -> bool:
        key, leaf = dotted_key(node), _leaf(node)
        return (key in self.keys or (leaf is not None and _ACCUM.search(leaf) is not None)
                or (isinstance(node, ast.Constant) and type(node.value) is int and node.value in self.literals))

    def uses(self, node: ast.expr) -> bool:
        """Does ``node`` read a count anywhere (``cfg.accum // world_size``, ``int(k)``)?"""
        return any(isinstance(sub, ast.expr) and self.is_count(sub) for sub in walk(node))

    def is_engine(self, node: ast.expr) -> bool:
        key, leaf = dotted_key(node), _leaf(node)
        return key in self.engines or (leaf is not None and _ENGINE.search(leaf) is not None)


def _target_keys(target: ast.expr) -> Iterator[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _target_keys(elt)
    elif (key := dotted_key(target)) is not None:
        yield key


def _is_number(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool)


def _reciprocal(node: ast.expr, counts: _Counts) -> ast.expr | None:
    """The count in ``1 / k`` or ``k ** -1`` (a factor that divides by it), or None."""
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _is_number(node.left)
            and counts.uses(node.right)):
        return node.right
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and counts.uses(node.left)
            and isinstance(node.right, ast.UnaryOp) and isinstance(node.right.op, ast.USub) and _is_number(node.right)):
        return node.left
    return None


def _helper_called(call: ast.Call, counts: _Counts) -> bool:
    return bool(counts.helpers) and _leaf(call.func) in counts.helpers


def _division(node: ast.expr, counts: _Counts, origin: Origin) -> ast.expr | None:
    """The first division by a count inside ``node`` (the divisor's node; a helper's call), or None."""
    for sub in walk(node):
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, (ast.Div, ast.FloorDiv)) and counts.uses(sub.right):
            if _is_number(sub.left):
                continue  # 1 / k alone is a factor, not a divided loss: its product is caught as x * (1 / k)
            return sub.right
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Mult):
            for factor in (sub.left, sub.right):
                if (count := _reciprocal(factor, counts)) is not None:
                    return count
        if isinstance(sub, ast.Call):
            name = (origin(sub.func) or "").split(".")[-1]
            if name in _DIV_METHODS:
                divisor = sub.args[-1] if sub.args else None
                if divisor is not None and counts.uses(divisor):
                    return divisor
            elif name in _MUL_METHODS:
                for factor in sub.args:
                    if (count := _reciprocal(factor, counts)) is not None:
                        return count
            elif _helper_called(sub, counts):
                return sub
    return None


def _shown(where: ast.AST) -> str:
    divisor = where.value if isinstance(where, ast.AugAssign) else where
    return ast.unparse(divisor) if isinstance(divisor, ast.expr) else "the accumulation count"


def _may_divide(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A short function that returns a value and divides or multiplies somewhere: a possible helper."""
    if (node.end_lineno or node.lineno) - node.lineno > HELPER_LINES:
        return False
    returns = scales = False
    for sub in walk(node):
        returns = returns or (isinstance(sub, ast.Return) and sub.value is not None)
        if isinstance(sub, (ast.BinOp, ast.AugAssign)):
            scales = scales or isinstance(sub.op, (ast.Div, ast.FloorDiv, ast.Mult))
        elif isinstance(sub, ast.Call):
            scales = scales or _leaf(sub.func) in (*_DIV_METHODS, *_MUL_METHODS)
    return returns and scales


def _returned_division(helper: ast.FunctionDef | ast.AsyncFunctionDef, counts: _Counts,
                       origin: Origin) -> ast.AST | None:
    """Where ``helper`` divides what it returns by a count (its own parameters defaulting to a count
    count too), or None."""
    args = helper.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [*zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True),
                *((a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None)]
    inner = counts.with_keys({a.arg for a, d in defaults if counts.uses(d)})
    scope = _Scope(inner, origin)
    scope.walk(helper.body)
    return scope.returned


class _Scope:
    """One function's (or the module's) statements walked in order: which names hold a divided
    loss, and the engine.backward calls that receive one."""

    def __init__(self, counts: _Counts, origin: Origin) -> None:
        self.counts = counts
        self.origin = origin
        self.divided: dict[str, ast.AST] = {}   # name -> where it was divided
        self.findings: list[tuple[ast.AST, str]] = []
        self.reported: set[ast.AST] = set()   # the nodes, not their ids: a dropped run's ids are reused
        self.returned: ast.AST | None = None   # where a returned value was divided

    def walk(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # its own scope
            self.statement(stmt)

    def _carried(self, value: ast.expr) -> ast.AST | None:
        """Where ``value``'s division happened: in it, or in a divided name it reads."""
        divisor = _division(value, self.counts, self.origin)
        if divisor is not None or not self.divided:
            return divisor
        for sub in walk(value):
            if isinstance(sub, (ast.Name, ast.Attribute)) and (key := dotted_key(sub)) in self.divided:
                return self.divided[key]
        return None

    def statement(self, stmt: ast.stmt) -> None:
        for call in _calls_in(stmt):
            self.check_backward(call)
        if isinstance(stmt, ast.Assign) or (isinstance(stmt, ast.AnnAssign) and stmt.value is not None):
            value = stmt.value
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            where = self._carried(value) if value is not None else None
            single = len(targets) == 1 and not isinstance(targets[0], (ast.Tuple, ast.List))
            for key in (k for t in targets for k in _target_keys(t)):
                if where is not None and single:
                    self.divided[key] = where
                else:
                    self.divided.pop(key, None)  # a new value: what it held before is gone
        elif isinstance(stmt, ast.AugAssign) and (name := dotted_key(stmt.target)) is not None:
            if isinstance(stmt.op, (ast.Div, ast.FloorDiv)) and self.counts.uses(stmt.value):
                self.divided[name] = stmt
            elif isinstance(stmt.op, ast.Mult) and _reciprocal(stmt.value, self.counts) is not None:
                self.divided[name] = stmt
            elif (carried := self._carried(stmt.value)) is not None:
                self.divided[name] = carried
        elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
              and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr in _IN_PLACE
              and (name := dotted_key(stmt.value.func.value)) is not None):   # loss.div_(k): changed in place
            where = _division(stmt.value, self.counts, self.origin)
            if where is not None:
                self.divided[name] = where
        elif isinstance(stmt, ast.Return) and stmt.value is not None and self.returned is None:
            self.returned = self._carried(stmt.value)
        for field in ("body", "orelse", "finalbody"):
            self.walk(getattr(stmt, field, []) or [])
        for handler in getattr(stmt, "handlers", []) or []:
            self.walk(handler.body)
        for case in getattr(stmt, "cases", []) or []:
            self.walk(case.body)

    def check_backward(self, call: ast.Call) -> None:
        func = call.func
        if not (isinstance(func, ast.Attribute) and func.attr == "backward" and call.args
                and self.counts.is_engine(func.value)):
            return
        where = self._carried(call.args[0])
        if where is None or where in self.reported:
            return
        self.reported.add(where)
        if isinstance(where, ast.Call) and _helper_called(where, self.counts):
            shown = f"{ast.unparse(where.func)}(): {self.counts.helpers[_leaf(where.func) or '']}"
        else:
            shown = _shown(where)
        self.findings.append((where, f"the loss passed to {ast.unparse(func)}() at line {call.lineno} "
                                     f"is divided by the gradient accumulation count ({shown}): "
                                     f"gradients come out that many times too small; {_FIX}"))


def _calls_in(stmt: ast.stmt) -> Iterator[ast.Call]:
    """The calls in ``stmt``'s own expressions (not in the statements nested in its body)."""
    nested = {id(s) for field in ("body", "orelse", "finalbody", "handlers", "cases")
              for s in (getattr(stmt, field, []) or [])}
    stack: list[ast.AST] = [child for child in child_nodes(stmt) if id(child) not in nested]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.stmt)):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(child_nodes(node))


class AccumulationCheck:
    """DSP008 over the module's runs of top-level statements, in order (see [Note: chunked parse]
    in chunked_parse.py): the module's own scope goes on from one run to the next, each function is
    walked within its run."""

    def __init__(self, counts: _Counts, origin: Origin) -> None:
        self._counts = counts
        self._origin = origin
        self._module = _Scope(counts, origin)

    def run(self, tree: ast.Module) -> list[tuple[ast.AST, str]]:
        """The findings in the next run of top-level statements."""
        self._module.findings = []
        self._module.walk(tree.body)
        findings = self._module.findings
        for _depth, node in statements_by_depth(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scope = _Scope(self._counts, self._origin)
                scope.walk(node.body)
                findings += scope.findings
        return findings


def accumulation_findings(tree: ast.Module, origin: Origin) -> list[tuple[ast.AST, str]]:
    """Each division of a loss by the accumulation count that reaches ``engine.backward``, as
    ``(node to report at, message)``; ``origin`` maps a call's function to its dotted import origin.

    Example::

        tree = ast.parse("loss = loss / grad_accum_steps\\nengine.backward(loss)\\n")
        accumulation_findings(tree, lambda f: None)   # [(<Name grad_accum_steps>, "the loss ...")]
    """
    sources = CountSources()
    sources.add(tree)
    return AccumulationCheck(sources.counts(origin), origin).run(tree)
