"""dspark.logs sits beside data and the engine, above comm: it imports only comm (the engine's step
statistics reach it as a public value), and nothing below it imports it."""

from __future__ import annotations

from pathlib import Path

import dspark
from tests.layering import imports_of

PACKAGE = Path(dspark.__file__).parent


def test_logs_imports_only_comm() -> None:
    files = sorted((PACKAGE / "logs").glob("*.py"))
    assert len(files) >= 4
    bad = {f"{path.name}: {name}" for path in files for name in imports_of(path)
           if name.startswith("dspark.") and not name.startswith(("dspark.logs", "dspark.comm"))}
    assert not bad, bad


def test_nothing_below_logs_imports_it() -> None:
    files = sorted(p for below in ("tensor", "comm", "data") for p in (PACKAGE / below).glob("*.py"))
    bad = {f"{path.parent.name}/{path.name}: {name}" for path in files for name in imports_of(path)
           if name.startswith("dspark.logs")}
    assert not bad, bad
