"""Models are leaves: nothing in dspark.models may import the engine, the bench or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import dspark.models

FORBIDDEN = ("dspark.engine", "dspark.bench", "dspark.cli")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_models_import_nothing_above_them() -> None:
    files = sorted(Path(dspark.models.__file__).parent.glob("*.py"))
    assert len(files) >= 5
    bad = {f"{path.name}: {name}" for path in files for name in _imports(path)
           if name.startswith(FORBIDDEN)}
    assert not bad, bad
