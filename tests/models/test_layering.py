"""Models are leaves: nothing in dspark.models may import the engine, the bench or the CLI."""

from __future__ import annotations

import dspark.models
from tests.layering import imports_of, package_files

FORBIDDEN = ("dspark.engine", "dspark.bench", "dspark.cli")


def test_models_import_nothing_above_them() -> None:
    files = package_files(dspark.models)
    assert len(files) >= 5
    bad = {f"{path.name}: {name}" for path in files for name in imports_of(path)
           if name.startswith(FORBIDDEN)}
    assert not bad, bad
