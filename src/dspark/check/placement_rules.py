"""Static rules for risky placements, read from the source with ``ast`` (the code is never imported).

The seed's bug was one argument, ``shard_dim=None``, that silently replicated a batch. These rules
find that argument, and its cousins, before anything runs. Each finding has a code:

DSP000 (error) the file cannot be read, parsed or analysed (the message says why: not UTF-8, a
    syntax error, code nested deeper than the checker follows). Fix: make it valid Python (the other
    rules cannot run on it); the other files are checked all the same
    (:mod:`dspark.check.driver`).
DSP001 (error) ``shard_dim=None`` (or ``Shard(None)``) in a DSpark call. DSpark raises
    ``PlacementError`` at run time; torch-style code would replicate silently. Fix: ``shard_dim=0``
    (or the dim to split), or ``shard_dim=dspark.REPLICATE`` when every rank needs the whole tensor.
DSP002 (error) ``dspark.distribute_tensor(t)`` without ``shard_dim``: it has no default, on purpose.
    Fix: pass ``shard_dim=0`` or ``shard_dim=dspark.REPLICATE``.
DSP003 (error) ``shard_dim`` is a float, str, bool or other non-int literal (``0.0``, ``"0"``,
    ``True``). Fix: an int literal such as ``0`` or ``-1``, or ``dspark.REPLICATE``.
DSP004 (error) ``shard_dim`` may be ``None``: a variable (or parameter default) that may still hold
    ``None`` where the call runs (a guard ``if dim is None: dim = 0`` or a later ``dim = 0`` is
    followed: :mod:`dspark.check.reaching_values`), or a value that is ``None`` on one path: a
    conditional with a ``None`` branch (``0 if fix else None``), an ``or`` ending in ``None``, an
    ``and`` with a ``None`` operand, or ``mapping.get(key)`` without a default; directly in the call
    or through the variable passed. Fix: give it an int
    (or ``dspark.REPLICATE``) on every path; do not use ``None`` to mean "not split".
DSP005 (error) PyTorch's ``distribute_tensor(t, mesh)`` without ``placements`` (or
    ``placements=None``): PyTorch then replicates the tensor on every rank without a word. Fix:
    ``placements=[Shard(0)]`` to split, or ``[Replicate()]`` written out when a copy is meant.
DSP006 (warning) a batch-looking value (a name with batch, input(s), data, or ``x`` as a word;
    or anything passed to ``distribute_batch``) is replicated (``REPLICATE`` / ``Replicate()``, also
    on one path of a conditional, directly or through a variable of the same scope):
    every rank then does all the work and N devices are no faster than one. Fix: ``shard_dim=0``;
    keep the replica only for a deliberate comparison (``# dspark: ignore[DSP006]`` on that line).
DSP007 (warning) in a file that uses DSpark, a ``torch.utils.data.DataLoader`` built with no
    ``sampler`` / ``batch_sampler``: every rank then reads the same batches, and N ranks train on
    one rank's data N times (the engine raises ``PlacementError`` at the first step). Fix:
    ``dspark.DataLoader(dataset, global_batch_size=...)``, which gives each rank its rows of every
    global batch; or a ``DistributedSampler``. A loader meant to read everything on every rank (an
    evaluation), or over an iterable dataset that splits itself by rank, is silenced with
    ``# dspark: ignore[DSP007]``.
DSP008 (error) a loss divided by the gradient accumulation count (``loss = loss /
    gradient_accumulation_steps``, ``loss /= k``, ``engine.backward(loss / k)``, ``loss.div_(k)``,
    ``loss.mul_(1.0 / k)``, ``loss * k ** -1``, a helper function that returns its argument divided)
    before ``engine.backward``: the engine already averages the window's micro-batches, so the gradients
    come out K times too small, silently. Fix: drop the division, ``engine.backward(loss)``. The
    rule and what counts as the count: :mod:`dspark.check.accumulation_rule`.
DSP009 (error) ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` over the engine's module
    under ``strategy="zero2"`` or ``"zero3"`` (or their hybrid forms): each rank holds only its rows
    of each gradient, inside the engine, so the clip would clip nothing (the engine raises
    ``ShardedGradError`` at run time); under any strategy, a clip of the engine's own
    ``parameters()`` (nanoGPT's ``model.parameters()`` where ``model = DDP(model)`` became the
    engine, which has none). Fix: ``Engine(clip_grad_norm=c)`` or ``engine.clip_grad_norm_(c)``.
DSP010 (error) ``optimizer.state_dict()`` (or ``load_state_dict``) of the engine's optimizer under
    ``strategy="zero1"``, ``"zero2"`` or ``"zero3"`` (or ``"hybrid-zero1/2/3"``): it holds only this
    rank's rows, so a saved state would be part of the state (the engine raises
    ``ShardedOptimizerStateError``). Fix: ``engine.save(path)`` / ``engine.load(path)``.
DSP011 (warning) either of those lines where the file's strategy cannot be read (a variable,
    ``"auto"``): right under ``replicate`` (the clip under ``zero1`` too), wrong under the others.
    How the rules read the module, the optimizer and the strategy: :mod:`dspark.check.habit_rules`.

A ``# dspark: ignore[DSPnnn]`` comment (or a bare ``# dspark: ignore``) on the finding's line
silences it; not ``# noqa``, which other linters own and would report as an unknown code.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dspark.check.accumulation_rule import AccumulationCheck, CountSources
from dspark.check.chunked_parse import (
    Run,
    collector_paused,
    parser_text,
    runs,
    second_walk,
    statements_by_depth,
    tree_kept,
)
from dspark.check.habit_rules import HabitSources
from dspark.check.reaching_values import ModuleFlow, Values, reaching_values
from dspark.check.tree_walk import child_nodes, dotted_key

__all__ = ["CODES", "Finding", "check_source"]

CODES: dict[str, tuple[str, str]] = {
    "DSP000": ("error", "cannot parse"),
    "DSP001": ("error", "shard_dim=None"),
    "DSP002": ("error", "missing shard_dim"),
    "DSP003": ("error", "shard_dim is not an int"),
    "DSP004": ("error", "shard_dim may be None"),
    "DSP005": ("error", "DTensor without placements replicates silently"),
    "DSP006": ("warning", "batch replicated"),
    "DSP007": ("warning", "DataLoader without a sampler"),
    "DSP008": ("error", "loss divided by the accumulation count"),
    "DSP009": ("error", "clip of the module's parameters clips nothing"),
    "DSP010": ("error", "state dict of a sharded optimizer"),
    "DSP011": ("warning", "clip or optimizer state dict right under some strategies only"),
}
"""Each code's severity and short title (the module docstring has the fix)."""

_FIX = "use shard_dim=0 to split it, or shard_dim=dspark.REPLICATE to copy it on purpose"
_BATCH_WORDS = re.compile(r"batch|inputs?|data")
_IGNORE = re.compile(r"#\s*dspark:\s*ignore(?:\[([\w, ]+)\])?", re.IGNORECASE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One risky placement at ``path:line:col`` (1-based line and column)."""

    path: str
    line: int
    col: int
    code: str
    message: str

    @property
    def severity(self) -> str:
        """``"error"`` or ``"warning"``."""
        return CODES[self.code][0]

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message}"


def _imports(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(depth, local name, the dotted origin it was imported as: ``dt`` -> ``torch.distributed.tensor``)
    for each import, in ``ast.walk``'s order; the runs' lists, sorted by depth, make the module's
    (see :func:`dspark.check.chunked_parse.statements_by_depth`)."""
    names: list[tuple[int, str, str]] = []
    for depth, node in statements_by_depth(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names.append((depth, alias.asname, alias.name))
                else:
                    top = alias.name.split(".")[0]
                    names.append((depth, top, top))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names.append((depth, alias.asname or alias.name, f"{node.module}.{alias.name}"))
    return names


def _origin(func: ast.expr, imports: dict[str, str]) -> str | None:
    dotted = dotted_key(func)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    base = imports.get(head, head)
    return f"{base}.{rest}" if rest else base


_Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef


def _outcomes(node: ast.expr, *, as_none: bool = False) -> list[ast.expr]:
    """The expressions ``node`` may evaluate to: both branches of a conditional, every operand of
    ``or`` / ``and``; any other expression is its own only outcome. ``as_none``: only those that can
    give ``None``: ``a or b`` gives ``a`` only when it is truthy, so only its last operand counts."""
    if isinstance(node, ast.IfExp):
        return [*_outcomes(node.body, as_none=as_none), *_outcomes(node.orelse, as_none=as_none)]
    if isinstance(node, ast.BoolOp):
        values = node.values[-1:] if as_none and isinstance(node.op, ast.Or) else node.values
        return [leaf for value in values for leaf in _outcomes(value, as_none=as_none)]
    return [node]


def _may_be_none(node: ast.expr) -> bool:
    """``None`` itself, or ``mapping.get(key)`` without a default."""
    if isinstance(node, ast.Constant):
        return node.value is None
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and len(node.args) == 1 and not node.keywords)


def _is_replicate(node: ast.expr | None, imports: dict[str, str]) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.Call):
        node = node.func
    origin = _origin(node, imports) or ""
    return origin.split(".")[-1] in ("REPLICATE", "Replicate")


def _words(node: ast.expr) -> list[str]:
    if isinstance(node, (ast.Tuple, ast.List)):
        return [w for elt in node.elts for w in _words(elt)]
    if isinstance(node, ast.Subscript):
        return _words(node.value)
    dotted = dotted_key(node)
    if dotted is None:
        return []
    leaf = dotted.split(".")[-1]
    return [w.lower() for w in re.split(r"_|(?<=[a-z])(?=[A-Z])", leaf) if w]


def _looks_like_batch(node: ast.expr) -> bool:
    return any(w == "x" or _BATCH_WORDS.search(w) for w in _words(node))


def _literal_keywords(node: ast.expr) -> dict[str, ast.expr] | None:
    """The entries of ``{"k": v}`` or ``dict(k=v)`` with only named keys, else None (unknown)."""
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                          for k in node.keys):
        return {k.value: v for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
            and not node.args and all(kw.arg is not None for kw in node.keywords)):
        return {kw.arg: kw.value for kw in node.keywords if kw.arg is not None}
    return None


def _arg(call: ast.Call, position: int, keyword: str,
         resolve: Callable[[ast.expr], ast.expr] | None = None) -> tuple[bool, ast.expr | None]:
    """(was it passed?, its expression). A ``*args`` / ``**kwargs`` call counts as passed: unknown,
    unless the mapping is a literal (``**{"shard_dim": None}``, ``**dict(...)``, or a name that holds
    one where the call runs, through ``resolve``)."""
    for kw in call.keywords:
        if kw.arg == keyword:
            return True, kw.value
        if kw.arg is None:
            entries = _literal_keywords(resolve(kw.value) if resolve else kw.value)
            if entries is None:
                return True, None
            if keyword in entries:
                return True, entries[keyword]
    if any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return True, None
    if len(call.args) > position:
        return True, call.args[position]
    return False, None


def _uses_dspark(imports: dict[str, str]) -> bool:
    return any(origin == "dspark" or origin.startswith("dspark.") for origin in imports.values())


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str, imports: dict[str, str]) -> None:
        self.path = path
        self.imports = imports
        self.uses_dspark = _uses_dspark(imports)
        self.findings: list[Finding] = []
        self.flows: list[dict[int, Values]] = []   # per enclosing scope: reaching values at its calls
        self._alias_calls: dict[int, ast.Call] = {}   # a partial's stand-in call -> the partial's call

    def _resolver(self, call: ast.Call) -> Callable[[ast.expr], ast.expr]:
        """A name's one known value where ``call`` runs (the expression itself otherwise)."""
        def resolve(expr: ast.expr) -> ast.expr:
            if isinstance(expr, ast.Name):
                values = self._reaching(call, expr.id)
                if len(values) == 1:
                    return values[0][0]
            return expr
        return resolve

    def _reaching(self, call: ast.Call, name: str) -> list[tuple[ast.expr, int]]:
        """The known values ``name`` may hold where ``call`` runs, in the innermost scope that ran it."""
        call = self._alias_calls.get(id(call), call)
        for flow in reversed(self.flows):
            if id(call) in flow:
                return [(expr, line) for expr, line in flow[id(call)].get(name, []) if expr is not None]
        return []

    def report(self, node: ast.AST, code: str, message: str) -> None:
        self.findings.append(Finding(path=self.path, line=getattr(node, "lineno", 1),
                                     col=getattr(node, "col_offset", 0) + 1, code=code, message=message))

    def visit_scope(self, node: _Scope) -> None:
        self.flows.append(reaching_values(node))
        self.generic_visit(node)
        self.flows.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = visit_ClassDef = visit_scope

    def generic_visit(self, node: ast.AST) -> None:
        for child in child_nodes(node):   # ast.NodeVisitor's order, at half its cost
            self.visit(child)

    def visit_run(self, tree: ast.Module, at_call: dict[int, Values]) -> None:
        """The next run of top-level statements, whose calls see the module's ``at_call``."""
        self.flows = [at_call]
        self.generic_visit(tree)
        self.flows = []

    def read_by_rules(self, expr: ast.expr) -> bool:
        """Does a rule read ``expr`` where a name bound to it reaches a call? A ``None`` or a
        replicate on one of its paths, or a literal mapping (see [Note: module flow by chunks])."""
        return (any(_may_be_none(leaf) for leaf in _outcomes(expr, as_none=True))
                or any(_is_replicate(leaf, self.imports) for leaf in _outcomes(expr))
                or _literal_keywords(expr) is not None)

    def visit_Call(self, node: ast.Call) -> None:
        origin = _origin(node.func, self.imports) or ""
        name = origin.split(".")[-1]
        if name == "partial" and node.args:   # functools.partial(dspark.distribute_batch, shard_dim=...)
            target = (_origin(node.args[0], self.imports) or "").split(".")[-1]
            if target in ("distribute_tensor", "distribute_batch") and any(
                    kw.arg == "shard_dim" or kw.arg is None for kw in node.keywords):
                bound = ast.copy_location(ast.Call(func=node.args[0], args=node.args[1:],
                                                   keywords=node.keywords), node)
                self._alias_calls[id(bound)] = node
                self.check_shard_dim(bound, target, required=False)
                del self._alias_calls[id(bound)]   # its id is free again once it is dropped
        if name == "distribute_tensor":
            self.check_distribute_tensor(node, origin)
        elif name == "distribute_batch":
            self.check_shard_dim(node, "distribute_batch", required=False)
        elif origin == "torch.utils.data.DataLoader" and self.uses_dspark:
            self.check_data_loader(node)
        elif name == "Shard":
            passed, value = _arg(node, 0, "dim")
            if passed and isinstance(value, ast.Constant) and value.value is None:
                self.report(node, "DSP001", f"Shard(None) is not a placement: {_FIX}")
        self.generic_visit(node)

    def check_distribute_tensor(self, node: ast.Call, origin: str) -> None:
        keywords = {kw.arg for kw in node.keywords}
        # dspark's takes (tensor, shard_dim); torch's takes (tensor, device_mesh, placements).
        is_torch = (origin.startswith("torch.") or bool(keywords & {"device_mesh", "placements"})
                    or len(node.args) >= 3)
        if origin.startswith("dspark.") or "shard_dim" in keywords:
            is_torch = False
        if not is_torch:
            self.check_shard_dim(node, "distribute_tensor", required=True)
            return
        passed, placements = _arg(node, 2, "placements")
        if not passed or (isinstance(placements, ast.Constant) and placements.value is None):
            self.report(node, "DSP005", "torch distribute_tensor without placements replicates the "
                        "tensor on every rank silently: pass placements=[Shard(0)] to split it, or "
                        "[Replicate()] to copy it on purpose")
        elif isinstance(placements, (ast.List, ast.Tuple)) and node.args:
            if any(_is_replicate(p, self.imports) for p in placements.elts) and _looks_like_batch(node.args[0]):
                self.report(node, "DSP006", f"{ast.unparse(node.args[0])!s} looks like a batch but is "
                            "placed with Replicate(): every rank does all the work; use Shard(0)")

    def check_data_loader(self, node: ast.Call) -> None:
        # torch.utils.data.DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, ...)
        for position, keyword in ((3, "sampler"), (4, "batch_sampler")):
            passed, value = _arg(node, position, keyword)
            if passed and not (isinstance(value, ast.Constant) and value.value is None):
                return
        self.report(node, "DSP007", "torch.utils.data.DataLoader without a sampler: every rank reads "
                    "the same batches and N ranks train on one rank's data; use "
                    "dspark.DataLoader(dataset, global_batch_size=...) (each rank gets its rows of "
                    "every global batch) or pass sampler=DistributedSampler(...)")

    def check_shard_dim(self, node: ast.Call, func: str, *, required: bool) -> None:
        passed, value = _arg(node, 1, "shard_dim", self._resolver(node))
        if not passed:
            if required:
                self.report(node, "DSP002", f"{func}() without shard_dim (it has no default): {_FIX}")
            return
        if value is None:  # hidden behind *args / **kwargs
            return
        # reported where the call is when the value sits elsewhere (a dict passed as **cfg)
        inside = node.lineno <= value.lineno <= (node.end_lineno or node.lineno)
        where: ast.AST = value if inside else node
        if isinstance(value, ast.Constant):
            if value.value is None:
                self.report(where, "DSP001", f"{func}(shard_dim=None) is not a placement: {_FIX}")
            elif isinstance(value.value, bool) or not isinstance(value.value, int):
                self.report(where, "DSP003", f"{func}(shard_dim={value.value!r}) is a "
                            f"{type(value.value).__name__}, not an int: {_FIX}")
            return
        # what the argument may be: its own outcomes, or those of every value that reaches the call
        # through its name (see dspark.check.reaching_values)
        bound = self._reaching(node, value.id) if isinstance(value, ast.Name) else []

        def because(found: tuple[ast.expr | None, int] | None) -> str | None:
            # why, for the one outcome found ("": the argument's own); unparsed for it alone
            if found is None:
                return None
            if found[0] is None:
                return ""
            name = value.id  # type: ignore[attr-defined]
            return f"{name!r} is {ast.unparse(found[0])} here (assigned at line {found[1]})"

        none = because(next((found for leaf, found in [
            *((leaf, (None, 0)) for leaf in _outcomes(value, as_none=True)),
            *((leaf, (expr, line)) for expr, line in bound for leaf in _outcomes(expr, as_none=True)),
        ] if _may_be_none(leaf)), None))
        if none is not None:
            self.report(where, "DSP004", f"{func}(shard_dim={ast.unparse(value)}) may be None"
                        f"{': ' + none if none else ''}: {_FIX}")
        outcomes = [*((leaf, (None, 0)) for leaf in _outcomes(value)),
                    *((leaf, (expr, line)) for expr, line in bound for leaf in _outcomes(expr))]
        replicated = because(next((found for leaf, found in outcomes if _is_replicate(leaf, self.imports)), None))
        if replicated is not None and (func == "distribute_batch"
                                       or (node.args and _looks_like_batch(node.args[0]))):
            batch = ast.unparse(node.args[0]) if node.args else "..."
            self.report(where, "DSP006", f"{func}({batch}, shard_dim="
                        f"{ast.unparse(value)}) replicates a batch{' (' + replicated + ')' if replicated else ''}"
                        ": every rank does all the work and N devices are no faster than one; use "
                        "shard_dim=0")


def _silenced(finding: Finding, lines: list[str]) -> bool:
    line = lines[finding.line - 1] if 0 < finding.line <= len(lines) else ""
    match = _IGNORE.search(line)
    if match is None:
        return False
    codes = match.group(1)
    return codes is None or finding.code in {c.strip().upper() for c in codes.split(",")}


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    """The risky placements in Python ``source``, in line order (see the module docstring).

    Example::

        check_source("import dspark\\nx = dspark.distribute_tensor(t, shard_dim=None)\\n", "a.py")
        # [Finding(path='a.py', line=2, col=39, code='DSP001', message='distribute_tensor(...')]
    """
    with collector_paused():   # see [Note: no cyclic collection while checking]
        return _findings(source, path)


def _findings(source: str, path: str) -> list[Finding]:
    text = parser_text(source)
    imports: list[tuple[int, str, str]] = []
    sources, habits = CountSources(), HabitSources()
    first: list[tuple[Run, ast.Module | None]] = []
    try:   # the first walk: what the whole module imports and counts (see [Note: chunked parse])
        for run, tree in runs(text, path):
            first.append((run, tree_kept(run, tree)))
            imports += _imports(tree)
            sources.add(tree, text[run.start:run.end])
            habits.add(tree)
        trees: Iterator[ast.Module] = second_walk(text, path, first)
    except SyntaxError:
        try:
            whole = ast.parse(source, filename=path)
        except SyntaxError as exc:
            return [Finding(path=path, line=exc.lineno or 1, col=exc.offset or 1, code="DSP000",
                            message=f"cannot parse: {exc.msg}")]
        imports, sources, habits = _imports(whole), CountSources(), HabitSources()   # never seen: the runs
        sources.add(whole)                                   # disagree with the file, then checked as one run
        habits.add(whole)
        trees = iter([whole])
    imports.sort(key=lambda entry: entry[0])
    checker = _Checker(path, {local: origin for _depth, local, origin in imports})
    flow = ModuleFlow(read=checker.read_by_rules)
    def origin(func: ast.expr) -> str | None:
        return _origin(func, checker.imports)

    counts = sources.counts(origin)
    accumulation = AccumulationCheck(counts, origin)
    habit_check = habits.facts(origin, counts.is_engine)
    for tree in trees:   # the second walk: each run's findings, then the run is dropped
        checker.visit_run(tree, flow.run(tree.body))
        for node, message in accumulation.run(tree):
            checker.report(node, "DSP008", message)
        for node, code, message in habit_check.run(tree):
            checker.report(node, code, message)
    lines = source.splitlines()
    kept = [f for f in checker.findings if not _silenced(f, lines)]
    return sorted(kept, key=lambda f: (f.line, f.col, f.code))
