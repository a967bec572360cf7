"""The whole import graph of src/dspark against the declared layers (CONTRIBUTING.md, "Layering"):
data flows one way, cli -> bench/check/launch -> engine/planner/data/checkpoint -> policy/meta/models
-> tensor -> comm, the engine imports the planner and never the reverse, host stands apart, and no
two modules import each other, lazily or not. A new upward import or circle
fails here, naming the importing file, the imported module and the rule it breaks."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import dspark
from tests.import_graph import (
    Import,
    Layers,
    cycles,
    import_graph,
    layer_of,
    layering_violations,
    modules_of,
    script_imports,
)
from tests.messages import assert_line_names, assert_names

SRC = Path(dspark.__file__).resolve().parent.parent
ROOT = SRC.parent

LAYERS = Layers(
    rank={
        # leaves: they import nothing of DSpark's, and anything may import them
        "errors": 0, "_version": 0, "cpu_malloc": 0, "profiler_banner": 0,
        "comm": 1,
        "tensor": 2,
        # the benchmark workloads: plain PyTorch models that the lab and the planner build; the
        # strategies' rules and meta materialisation, which the engine and the planner both read
        "models": 3, "policy": 3, "meta": 3,
        # of engine and planner only one may import the other (strategy="auto" must not make a
        # circle): layers of one rank are held to one direction by the layer-circle rule, and
        # ENGINE_OVER_PLANNER below says which
        "engine": 4, "planner": 4, "data": 4, "checkpoint": 4,
        # print, log_dir, Tracker, progress: above comm only (engine.step_stats() reaches the
        # tracker as a value)
        "logs": 4,
        # `dspark` itself: the public API that bench's workers use like any training script
        "dspark": 5, "bench": 5, "check": 5, "launch": 5,
        "cli": 6,
    },
    apart={
        # host probing: reports comm's backends; `dspark env` shows it, the planner reads the
        # machine's memory from it
        "host": (frozenset({"comm", "_version", "errors"}), frozenset({"cli", "planner"})),
    },
)

KNOWN_CIRCLES: dict[frozenset[str], str] = {}
"""Circles tolerated until the work named beside each removes them (listing one that is gone fails)."""


def test_the_import_graph_keeps_the_layers() -> None:
    edges = import_graph(SRC)
    assert len(modules_of(SRC)) > 100 and len(edges) > 300, "the graph should cover all of DSpark"
    assert not (problems := layering_violations(edges, LAYERS, known_circles=KNOWN_CIRCLES)), \
        "\n".join(problems)


def test_the_engine_imports_the_planner_and_never_the_reverse() -> None:
    """[Note: auto as a plain function]: ``Engine(strategy="auto")`` calls the planner, so the planner
    may not import the engine, lazily or not (what both read lives in dspark.policy and dspark.meta)."""
    edges = import_graph(SRC)
    assert any(e.importer.startswith("dspark.engine") and e.imported.startswith("dspark.planner")
               for e in edges), "the engine should call the planner for strategy='auto'"
    upward = [f"{e.where()}: {e.importer} imports {e.imported}" for e in edges
              if e.importer.startswith("dspark.planner") and e.imported.startswith("dspark.engine")]
    assert not upward, "the planner imports the engine:\n" + "\n".join(upward)


def test_lazy_and_type_only_imports_are_in_the_graph(tmp_path: Path) -> None:
    module = tmp_path / "dspark" / "engine" / "lazy.py"
    module.parent.mkdir(parents=True)
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from dspark.data.loader import DataLoader\n"
                      "def f():\n    from ..tensor import batch\n"
                      "    import importlib\n    importlib.import_module('dspark.comm.world')\n")
    for name in ("data/loader", "tensor/batch", "comm/world"):
        (tmp_path / "dspark" / f"{name}.py").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dspark" / f"{name}.py").write_text("")
    assert [(e.imported, e.line) for e in import_graph(tmp_path)] == [
        ("dspark.data.loader", 3), ("dspark.tensor.batch", 5), ("dspark.comm.world", 7)]


def _copy_of_the_source(tmp_path: Path) -> Path:
    shutil.copytree(SRC / "dspark", tmp_path / "dspark", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_planted_upward_import_fails_naming_file_module_and_rule(tmp_path: Path) -> None:
    src = _copy_of_the_source(tmp_path)
    stats = src / "dspark" / "comm" / "stats.py"
    stats.write_text(stats.read_text() + "\n\ndef _planted():\n    from dspark.cli import main\n")
    planted_line = len(stats.read_text().splitlines())
    problems = layering_violations(import_graph(src), LAYERS, known_circles=KNOWN_CIRCLES)
    (problem,) = [p for p in problems if "comm/stats.py" in p]
    assert f"dspark/comm/stats.py:{planted_line}" in problem
    assert "dspark.cli.main" in problem and "upward import" in problem
    assert "comm (layer 1" in problem and "cli (layer 6" in problem


def test_a_planted_circle_fails_naming_both_modules(tmp_path: Path) -> None:
    src = _copy_of_the_source(tmp_path)
    shm = src / "dspark" / "comm" / "shm_transport.py"
    shm.write_text(shm.read_text() + "\n\ndef _planted():\n    from dspark.comm import collectives\n")
    problems = layering_violations(import_graph(src), LAYERS, known_circles=KNOWN_CIRCLES)
    (problem,) = [p for p in problems if p.startswith("import circle")]
    assert "dspark.comm.collectives" in problem and "dspark.comm.shm_transport" in problem
    assert "dspark/comm/shm_transport.py:" in problem


def test_the_rules_on_a_synthetic_graph() -> None:
    def edge(a: str, b: str) -> Import:
        return Import(a, b, a.replace(".", "/") + ".py", 1)

    assert layering_violations([edge("dspark.engine.x", "dspark.comm.y")], LAYERS) == []
    (up,) = layering_violations([edge("dspark.tensor.x", "dspark.engine.y")], LAYERS)
    assert up.startswith("dspark/tensor/x.py:1: "), up
    assert_line_names(up, "dspark.engine.y", "upward")
    (apart,) = layering_violations([edge("dspark.bench.x", "dspark.host.y")], LAYERS)
    assert_names(apart, "host (apart", "bench")
    (unknown,) = layering_violations([edge("dspark.attic.x", "dspark.comm.y")], LAYERS)
    assert_names(unknown, "'attic'")
    both_ways = [edge("dspark.engine.x", "dspark.planner.y"), edge("dspark.planner.z", "dspark.engine.w")]
    (layer_circle,) = layering_violations(both_ways, LAYERS)
    assert_line_names(layer_circle, "circle", "engine, planner")
    known = {frozenset({"dspark.engine.a", "dspark.engine.b"}): "being removed"}
    (stale,) = layering_violations([], LAYERS, known_circles=known)
    assert "is gone" in stale
    ring = [edge("a.x", "a.y"), edge("a.y", "a.z"), edge("a.z", "a.x"), edge("a.z", "a.w")]
    assert cycles(ring) == [["a.x", "a.y", "a.z"]]


# The lab's one door ([Note: the lab's one door] in dspark/engine/for_the_lab.py): dspark/bench/ and
# the scripts in benchmarks/ use the training core through the public names of its packages and the
# one module that declares what else they need.

CORE = frozenset({"comm", "tensor", "policy", "meta", "engine", "planner", "data", "checkpoint", "logs"})
"""The training core's packages, which the lab may not reach into (``dspark.models`` holds the lab's
workloads and the planner's test models: plain PyTorch, open to it)."""
LAB_DOOR = "dspark.engine.for_the_lab"


def _public_names(package: str) -> frozenset[str]:
    """The names a package's ``__init__.py`` lists in ``__all__``, read with ``ast``."""
    init = SRC / package.replace(".", "/") / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def lab_door_violations(edges: list[Import], names: dict[Import, list[str]]) -> list[str]:
    """Each import by the lab (``edges``, with the names each imports) of the core that is neither
    its package's public names nor the declared module, one line naming the file, the module and
    the way in."""
    problems = []
    for edge in edges:
        layer = layer_of(edge.imported)
        if layer not in CORE or edge.imported == LAB_DOOR:
            continue
        if edge.imported != f"dspark.{layer}":
            problems.append(f"{edge.where()}: imports {edge.imported}, inside the training core: "
                            f"use the public names of dspark.{layer}, or add what the lab needs to "
                            f"{LAB_DOOR}")
            continue
        hidden = sorted(set(names.get(edge, ())) - _public_names(edge.imported))
        if hidden:
            problems.append(f"{edge.where()}: imports {', '.join(hidden)} from {edge.imported}, "
                            f"not in its __all__: add what the lab needs to {LAB_DOOR}")
    return problems


def _lab_imports() -> tuple[list[Import], dict[Import, list[str]]]:
    edges = [e for e in import_graph(SRC) if e.importer.startswith("dspark.bench")]
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        edges += script_imports(script, SRC, root=ROOT)
    names: dict[Import, list[str]] = {}
    for edge in edges:  # the names `from PACKAGE import a, b` takes, for the package's own imports
        path = ROOT / edge.file if not edge.file.startswith("dspark/") else SRC / edge.file
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.ImportFrom) and node.module == edge.imported
                    and node.lineno == edge.line):
                names[edge] = [alias.name for alias in node.names]
    return edges, names


def test_the_lab_reaches_the_core_only_through_public_names_and_its_one_door() -> None:
    edges, names = _lab_imports()
    assert len({e.file for e in edges}) > 40, "the lab's modules and the benchmark scripts"
    assert not (problems := lab_door_violations(edges, names)), "\n".join(problems)


def test_every_name_of_the_door_is_used_by_the_lab() -> None:
    import dspark.engine.for_the_lab as door

    edges, names = _lab_imports()
    used = {name for edge in edges if edge.imported == LAB_DOOR for name in names.get(edge, ())}
    assert set(door.__all__) - used == set(), "names the lab no longer needs: remove them"


def test_the_lab_rule_names_a_planted_way_in() -> None:
    inside = Import("benchmarks/x.py", "dspark.engine.grad_reducer", "benchmarks/x.py", 3)
    hidden = Import("dspark.bench.measure.y", "dspark.planner", "dspark/bench/measure/y.py", 7)
    fine = [Import("benchmarks/x.py", LAB_DOOR, "benchmarks/x.py", 4),
            Import("benchmarks/x.py", "dspark.launch.launcher", "benchmarks/x.py", 5)]
    first, second = lab_door_violations([inside, hidden, *fine],
                                        {hidden: ["plan", "table"], fine[0]: ["wire_bytes"]})
    assert first.startswith("benchmarks/x.py:3: ")
    assert_names(first, "dspark.engine.grad_reducer", LAB_DOOR)
    assert second.startswith("dspark/bench/measure/y.py:7: ")
    assert_names(second, "table", "dspark.planner", LAB_DOOR)
    assert "plan," not in second


# Below: what a layer may reach for outside DSpark (kept from the per-package tests this replaced).

def _external_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _files(layer: str) -> list[Path]:
    files = sorted((SRC / "dspark" / layer).rglob("*.py"))
    assert len(files) >= 4, f"dspark/{layer} should hold its modules"
    return files


def test_comm_does_not_probe_the_host() -> None:
    layer = "comm"
    probing = ("subprocess", "shutil", "platform", "psutil")  # host probing is dspark.host's job
    bad = {f"{p.name}: {n}" for p in _files(layer) for n in _external_imports(p)
           if n.split(".")[0] in probing}
    assert not bad, f"comm/ imports host-probing tools (move the probe to dspark.host): {bad}"
    probed = re.compile(r"(^|[\s'\"])/(sys|proc)(/|$|[\s'\"])")
    paths = {f"{p.name}: {node.value[:60]!r}" for p in _files(layer)
             for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and probed.search(node.value)}
    assert not paths, f"comm/ reads /sys or /proc (move the probe to dspark.host): {paths}"


def test_host_starts_no_process_group() -> None:
    bad = {f"{p.name}: {n}" for p in _files("host") for n in _external_imports(p)
           if n.startswith("torch.distributed")}
    assert not bad, bad
    edges = [e for e in import_graph(SRC) if e.importer.startswith("dspark.host")]
    assert {e.imported for e in edges if e.imported.startswith("dspark.comm")} <= {"dspark.comm"}, \
        "host reports comm's backends through the package's public names, no more"
