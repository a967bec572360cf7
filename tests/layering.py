"""What a package's modules import and spell, read from their source (no import needed): the
layering tests of each package use it to keep `cli -> bench/engine -> tensor -> comm` one-way."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType


def package_files(package: ModuleType) -> list[Path]:
    """The ``.py`` files of ``package`` (its own folder, sub-packages included)."""
    return sorted(Path(str(package.__file__)).parent.rglob("*.py"))


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, and ``module.name`` for each ``from module import name``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def string_constants(path: Path) -> set[str]:
    """The string literals in ``path`` (docstrings included)."""
    return {node.value for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}
