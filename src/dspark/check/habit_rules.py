"""DSP009-DSP011: two lines kept from a DDP loop that the strategy turns wrong, read from the source.

[Note: habits the strategy decides] A DDP loop clips with ``torch.nn.utils.clip_grad_norm_(
model.parameters(), c)`` and saves ``optimizer.state_dict()``. Ported to a ``dspark.Engine``, both
work under ``strategy="replicate"``, and the clip under ``"zero1"`` too; under the others the module's
parameters hold no gradient (zero2, zero3: the clip would clip nothing) and the optimizer holds only
this rank's rows (zero1-3: the state dict would be part of the state). The engine raises at run time
(:mod:`dspark.engine.sharded_grad`, :mod:`dspark.engine.optimizer_guard`); these rules find the lines
before anything runs, where the strategy can be read:

- the module's parameters: ``<engine>.module.parameters()``, a name assigned from ``<engine>.module``,
  or the model passed as the engine's first argument under another name (``engine =
  dspark.Engine(raw_model, ...)``, then ``raw_model.parameters()``); a clip of ``<engine>.parameters()``
  (nanoGPT's ``model.parameters()``, ``model`` now the engine) is DSP009 under every strategy: the
  engine has no ``parameters()`` (see [Note: the engine is not the model] in
  :mod:`dspark.engine.not_a_module`);
- the engine's optimizer: ``<engine>.optimizer``, or a name assigned from it;
- the strategy: each ``dspark.Engine(...)`` call of the file, its ``strategy=`` a string, a name
  the module assigns one string only, or left out (``"replicate"``; beside ``config=`` or
  ``**options``, the config's: not read).

A strategy read that says zero2/zero3 (the clip) or zero1-3 (the state dict) is an error (DSP009,
DSP010); one that cannot be read (a variable, ``"auto"``) a warning (DSP011) saying under which
strategies the line is right; ``"replicate"`` (and ``"zero1"`` for the clip) nothing. An engine is
what :mod:`dspark.check.accumulation_rule` calls one.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Collection

from dspark.check.chunked_parse import statements_by_depth
from dspark.check.tree_walk import dotted_key, walk

__all__ = ["HabitCheck", "HabitSources"]

Origin = Callable[[ast.expr], "str | None"]
IsEngine = Callable[[ast.expr], bool]
_CLIPS = ("clip_grad_norm_", "clip_grad_value_")
# the strategies whose policy shards gradients / optimizer state (tests/check/test_habit_rules.py
# holds them to dspark.policy's table; spelled out so that the checker stays a static reader)
_NO_GRADIENT = ("zero2", "zero3", "hybrid-zero2", "hybrid-zero3")   # the module's parameters hold no gradient
_SHARDED_STATE = ("zero1", "zero2", "zero3", "hybrid-zero1", "hybrid-zero2", "hybrid-zero3")   # this rank's rows


_UNREAD = ast.Constant(value=None)
"""The strategy of an engine built from a config: one that cannot be read (DSP011)."""


class HabitSources:
    """What the module says about its engines, gathered a run of top-level statements at a time (see
    [Note: chunked parse] in chunked_parse.py): each ``Engine(...)`` call's strategy and model, the
    strings the module assigns to names, and names assigned from an attribute (``x = e.optimizer``)."""

    def __init__(self) -> None:
        # (func, strategy= value or None when left out, first argument's key, target keys)
        self._engines: list[tuple[ast.expr, ast.expr | None, str | None, tuple[str, ...]]] = []
        self._strings: dict[str, set[str | None]] = {}   # module-level name -> strings assigned (None: other)
        self._attributes: list[tuple[tuple[str, ...], str, str]] = []   # (targets, base key, attribute)

    def add(self, tree: ast.Module) -> None:
        """Note the next run of the module's top-level statements."""
        for depth, node in statements_by_depth(tree):
            if not isinstance(node, ast.Assign):
                continue
            targets = tuple(k for t in node.targets if (k := dotted_key(t)) is not None)
            value = node.value
            if depth == 1:
                for target in targets:
                    text = value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
                    self._strings.setdefault(target, set()).add(text)
            if isinstance(value, ast.Call) and (dotted_key(value.func) or "").split(".")[-1] == "Engine":
                given = {kw.arg: kw.value for kw in value.keywords}   # None: **options
                # no strategy= beside config= or **options: the config's, which this file does not fix
                strategy = given.get("strategy", _UNREAD if {"config", None} & given.keys() else None)
                model = dotted_key(value.args[0]) if value.args else None
                self._engines.append((value.func, strategy, model, targets))
            elif isinstance(value, ast.Attribute) and value.attr in ("module", "optimizer"):
                base = dotted_key(value.value)
                if base is not None:
                    self._attributes.append((targets, base, value.attr))

    def facts(self, origin: Origin, is_engine: IsEngine) -> HabitCheck:
        """The check for the second walk, once every run was added."""
        engines = [(strategy, model, targets) for func, strategy, model, targets in self._engines
                   if (origin(func) or "").split(".")[-1] == "Engine"]
        strategies = {self._strategy(strategy) for strategy, _model, _targets in engines}
        engine_keys = {t for _s, _m, targets in engines for t in targets}
        modules = {model for _s, model, _t in engines if model is not None and model not in engine_keys}
        optimizers: set[str] = set()
        for targets, base, attr in self._attributes:
            if base in engine_keys or is_engine(ast.Name(id=base.split(".")[-1])):
                (modules if attr == "module" else optimizers).update(targets)
        return HabitCheck(strategies if engines else set(), modules=modules, optimizers=optimizers,
                          origin=origin, is_engine=lambda node: dotted_key(node) in engine_keys or is_engine(node))

    def _strategy(self, node: ast.expr | None) -> str | None:
        """The strategy ``node`` names, or None when it cannot be read."""
        if node is None:
            return "replicate"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return None if node.value == "auto" else node.value
        if isinstance(node, ast.Name):
            values = self._strings.get(node.id, set())
            if len(values) == 1 and (value := next(iter(values))) not in (None, "auto"):
                return value
        return None


class HabitCheck:
    """DSP009-DSP011 over each run of the module's top-level statements (see the module note)."""

    def __init__(self, strategies: set[str | None], *, modules: Collection[str], optimizers: Collection[str],
                 origin: Origin, is_engine: IsEngine) -> None:
        self.strategies = strategies
        """The file's engines' strategies (None: one that cannot be read); empty: no engine built."""
        self.modules = modules
        self.optimizers = optimizers
        self.origin = origin
        self.is_engine = is_engine

    def run(self, tree: ast.Module) -> list[tuple[ast.AST, str, str]]:
        """``(node, code, message)`` for each finding in the next run."""
        if not self.strategies:
            return []
        findings: list[tuple[ast.AST, str, str]] = []
        for node in walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = self.origin(node.func) or ""
            if name.startswith("torch.") and name.split(".")[-1] in _CLIPS and node.args:
                found = self._clip(node)
            elif isinstance(node.func, ast.Attribute) and node.func.attr in ("state_dict", "load_state_dict"):
                found = self._state_dict(node, node.func)
            else:
                continue
            if found is not None:
                findings.append((node, *found))
        return findings

    def _is_module(self, node: ast.expr) -> bool:
        return (dotted_key(node) in self.modules
                or (isinstance(node, ast.Attribute) and node.attr == "module" and self.is_engine(node.value)))

    def _verdict(self, line: str, wrong_under: tuple[str, ...], *, code: str, wrong: str, fix: str
                 ) -> tuple[str, str] | None:
        """``code`` with ``line`` wrong under a strategy the file sets (``wrong``: why, after the
        strategy), DSP011 when a strategy cannot be read, None when every strategy read is right."""
        found = sorted(s for s in self.strategies if s in wrong_under)
        if found:
            return code, f"{line} under strategy={found[0]!r}: {wrong}; {fix}"
        if None in self.strategies:
            return "DSP011", (f"{line} with a strategy this file does not fix: wrong under "
                              f"{', '.join(map(repr, wrong_under))} ({wrong}); {fix}")
        return None

    def _clip(self, call: ast.Call) -> tuple[str, str] | None:
        params = call.args[0]
        if not (isinstance(params, ast.Call) and isinstance(params.func, ast.Attribute)
                and params.func.attr == "parameters"):
            return None
        owner, line = params.func.value, f"{ast.unparse(call.func)}({ast.unparse(params)}, ...)"
        fix = ("clip with dspark.Engine(..., clip_grad_norm=c) or norm = engine.clip_grad_norm_(c) between "
               "the last engine.backward() and engine.step() (the global norm over every rank's rows)")
        if not self._is_module(owner):
            if not self.is_engine(owner):
                return None
            # nanoGPT's clip of model.parameters() where model = DDP(model) became the engine
            return "DSP009", (f"{line}: {ast.unparse(owner)} is the dspark.Engine, not the model, and has no "
                              f"parameters() (at run time an AttributeError under every strategy); {fix}")
        return self._verdict(
            line, _NO_GRADIENT, code="DSP009",
            wrong="each rank holds only its rows of each gradient, inside the engine, so the module's "
                  "parameters hold none and this clips nothing (at run time it raises ShardedGradError)",
            fix=fix)

    def _state_dict(self, call: ast.Call, func: ast.Attribute) -> tuple[str, str] | None:
        owner = func.value
        if not (dotted_key(owner) in self.optimizers
                or (isinstance(owner, ast.Attribute) and owner.attr == "optimizer" and self.is_engine(owner.value))):
            return None
        return self._verdict(
            f"{ast.unparse(call.func)}()", _SHARDED_STATE, code="DSP010",
            wrong="the optimizer holds only this rank's rows, so its state dict is part of the state (at run "
                  "time it raises ShardedOptimizerStateError)",
            fix="save with engine.save(path, extra={...}) on every rank and resume with engine.load(path), "
                "the whole state at any world size")
