"""DSpark's import graph read from the source with ``ast`` (nothing is imported), and the rules of
its layers: the checker behind tests/test_layering.py, kept apart so that a test can feed it a planted
import and watch it fail.

Every import counts: at the top of a module, inside a function (a lazy import still ties the two
modules together), and under ``if TYPE_CHECKING`` (a type named from a layer above is a dependency
on it all the same).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT_PACKAGE = "dspark"


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement: ``importer`` (a module) imports ``imported`` (a module of the graph)
    at ``file:line``."""

    importer: str
    imported: str
    file: str
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True, slots=True)
class Layers:
    """The declared layering. ``rank``: each layer's height; a layer may import its own modules
    and any layer of a lower rank, and layers of one rank may import each other in one direction
    only. ``apart``: layers outside the ranking, each with the layers it may import and the layers
    that may import it."""

    rank: Mapping[str, int]
    apart: Mapping[str, tuple[frozenset[str], frozenset[str]]]

    def describe(self, layer: str) -> str:
        if layer in self.apart:
            imports, importers = self.apart[layer]
            return (f"{layer} (apart: imports only {', '.join(sorted(imports)) or 'nothing'}; "
                    f"imported only by {', '.join(sorted(importers)) or 'nothing'})")
        same = sorted(name for name, r in self.rank.items() if r == self.rank[layer])
        return f"{layer} (layer {self.rank[layer]}: {'/'.join(same)})"


def modules_of(src: Path) -> dict[str, Path]:
    """Every module under ``src`` (the folder holding the ``dspark`` package), by dotted name; a
    package is named by its ``__init__.py``."""
    found = {}
    for path in sorted((src / ROOT_PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module of the graph that ``name`` (a module, or a name inside one) belongs to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, package: str, modules: Mapping[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: climb from this module's package
            parts = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]  # importlib.import_module("dspark.x"), a literal name
    return []


def import_graph(src: Path) -> list[Import]:
    """Every import of a DSpark module by another, anywhere in the source under ``src``.

    Example::

        [i for i in import_graph(Path("src")) if i.importer == "dspark.comm.world"]
    """
    modules = modules_of(src)
    edges: list[Import] = []
    for module, path in modules.items():
        file = str(path.relative_to(src.parent)) if path.is_relative_to(src.parent) else str(path)
        edges += _imports_in(path, module, file, modules)
    return edges


def script_imports(path: Path, src: Path, *, root: Path) -> list[Import]:
    """The imports of DSpark's modules (those under ``src``) by a script outside the package, such as
    ``benchmarks/NAME.py``; the importer is named by its path relative to ``root``.

    Example::

        script_imports(Path("benchmarks/zero3_units.py"), Path("src"), root=Path("."))
    """
    name = str(path.relative_to(root))
    return _imports_in(path, name, name, modules_of(src))


def _imports_in(path: Path, module: str, file: str, modules: Mapping[str, Path]) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: dict[Import, None] = {}  # ordered, each import once (`from m import a, b` is one)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        for target in _targets(node, package, modules):
            if target.split(".")[0] != ROOT_PACKAGE:
                continue
            imported = _resolve(target, modules)
            if imported is not None and imported != module:
                edges[Import(module, imported, file, getattr(node, "lineno", 0))] = None
    return list(edges)


def layer_of(module: str) -> str:
    """The layer a module belongs to: its sub-package of ``dspark``, or the top-level module's own
    name (``dspark.errors`` -> ``errors``); ``dspark`` itself is the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT_PACKAGE


def cycles(edges: Iterable[Import], key: str = "module") -> list[list[str]]:
    """The import circles of ``edges``: each strongly connected set of modules (``key="module"``)
    or of layers (``key="layer"``) with more than one member, members sorted.

    Example::

        cycles([Import("a", "b", "a.py", 1), Import("b", "a", "b.py", 1)])   # [["a", "b"]]
    """
    graph: dict[str, set[str]] = {}
    for edge in edges:
        a, b = ((edge.importer, edge.imported) if key == "module"
                else (layer_of(edge.importer), layer_of(edge.imported)))
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    # Tarjan's algorithm, iterative (a long chain of modules would exhaust Python's stack).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return sorted(found)


def _same_rank(a: str, b: str, layers: Layers) -> bool:
    return a in layers.rank and b in layers.rank and layers.rank[a] == layers.rank[b]


def layering_violations(edges: list[Import], layers: Layers, *,
                        known_circles: Mapping[frozenset[str], str] | None = None) -> list[str]:
    """Every way ``edges`` break ``layers``, one line each naming the importing file, the imported
    module and the rule: a layer missing from the table, an import upward or into a layer kept
    apart, a circle between modules (``known_circles`` lists those tolerated for now, each with the
    reason, and a listed circle that is gone is reported too, so the list cannot go stale), and
    layers of one rank importing each other both ways.

    Example::

        layering_violations(import_graph(Path("src")), LAYERS)   # [] when the layering holds
    """
    known = dict(known_circles or {})
    problems: list[str] = []
    table = set(layers.rank) | set(layers.apart)
    for module in sorted({e.importer for e in edges} | {e.imported for e in edges}):
        if layer_of(module) not in table:
            problems.append(f"{module}: layer {layer_of(module)!r} is not in the table of layers "
                            f"(add it to LAYERS in tests/test_layering.py at the height it belongs)")
    for edge in edges:
        a, b = layer_of(edge.importer), layer_of(edge.imported)
        if a == b or a not in table or b not in table:
            continue
        rule = None
        if a in layers.apart and b not in layers.apart[a][0]:
            rule = f"{layers.describe(a)} may not import {b}"
        elif b in layers.apart and a not in layers.apart[b][1]:
            rule = f"{layers.describe(b)} may not be imported by {a}"
        elif a not in layers.apart and b not in layers.apart and layers.rank[b] > layers.rank[a]:
            rule = f"upward import: {layers.describe(a)} sits below {layers.describe(b)}"
        if rule is not None:
            problems.append(f"{edge.where()}: imports {edge.imported}: {rule}")
    for members in cycles(edges, key="module"):
        if frozenset(members) in known:
            known.pop(frozenset(members))
            continue
        links = [f"{e.where()} imports {e.imported}" for e in edges
                 if e.importer in members and e.imported in members]
        problems.append(f"import circle between {', '.join(members)}: {'; '.join(links)}")
    level = [e for e in edges if _same_rank(layer_of(e.importer), layer_of(e.imported), layers)]
    for members in cycles(level, key="layer"):  # an upward import is reported above already
        links = sorted({f"{e.where()} imports {e.imported}" for e in level
                        if layer_of(e.importer) in members and layer_of(e.imported) in members
                        and layer_of(e.importer) != layer_of(e.imported)})
        problems.append(f"circle between the layers {', '.join(members)} (one may import the "
                        f"other, not both): {'; '.join(links)}")
    for members, reason in known.items():
        problems.append(f"the known circle between {', '.join(sorted(members))} ({reason}) is gone: "
                        f"remove it from KNOWN_CIRCLES")
    return problems
