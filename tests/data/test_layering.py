"""dspark.data sits beside the engine, above tensor and comm: it imports only those two, and nothing
below it imports it."""

from __future__ import annotations

from pathlib import Path

import dspark
from tests.layering import imports_of as _imports

PACKAGE = Path(dspark.__file__).parent


def test_data_imports_only_tensor_and_comm() -> None:
    files = sorted((PACKAGE / "data").glob("*.py"))
    assert len(files) >= 4
    bad = {f"{path.name}: {name}" for path in files for name in _imports(path)
           if name.startswith("dspark.") and not name.startswith(("dspark.data", "dspark.tensor", "dspark.comm"))}
    assert not bad, bad


def test_nothing_below_data_imports_it() -> None:
    files = sorted(p for below in ("tensor", "comm") for p in (PACKAGE / below).glob("*.py"))
    bad = {f"{path.parent.name}/{path.name}: {name}" for path in files for name in _imports(path)
           if name.startswith("dspark.data")}
    assert not bad, bad
