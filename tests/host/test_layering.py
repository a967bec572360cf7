"""dspark.host probes the machine for `dspark env` and nothing more: it sits beside comm/ (whose
backend list it reports), imports no layer above, and never starts a process group."""

from __future__ import annotations

import dspark.host
from tests.layering import imports_of, package_files

ALLOWED = ("dspark.host", "dspark._version", "dspark.comm")


def test_host_imports_no_layer_above_it() -> None:
    files = package_files(dspark.host)
    assert len(files) >= 6
    bad = {f"{path.name}: {name}" for path in files for name in imports_of(path)
           if name.startswith("dspark") and not name.startswith(ALLOWED)}
    assert not bad, bad


def test_host_starts_no_process_group() -> None:
    calls = {f"{path.name}: {name}" for path in package_files(dspark.host) for name in imports_of(path)
             if name.startswith(("torch.distributed", "dspark.comm.collectives", "dspark.comm.world.init"))}
    assert not calls, calls
