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
    layering_violations,
    modules_of,
)
from tests.messages import assert_line_names, assert_names

SRC = Path(dspark.__file__).resolve().parent.parent

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
