"""comm/ holds communication alone: it is the bottom layer, and it does not probe the host (that
is dspark.host's job, for `dspark env`)."""

from __future__ import annotations

import re

import dspark.comm
from tests.layering import imports_of, package_files, string_constants

# What host probing reaches for: tools run as subprocesses, /sys and /proc files, the host package.
PROBING_IMPORTS = ("subprocess", "shutil", "platform", "dspark.host")
PROBED_PATHS = re.compile(r"(^|[\s'\"])/(sys|proc)(/|$|[\s'\"])")


def test_comm_imports_only_itself_and_the_errors() -> None:
    files = package_files(dspark.comm)
    assert len(files) >= 4
    bad = {f"{path.name}: {name}" for path in files for name in imports_of(path)
           if name.startswith("dspark") and not name.startswith(("dspark.comm", "dspark.errors"))}
    assert not bad, bad


def test_comm_does_not_probe_the_host() -> None:
    files = package_files(dspark.comm)
    assert "topology.py" not in {path.name for path in files}
    imports = {f"{path.name}: {name}" for path in files for name in imports_of(path)
               if name.split(".")[0] in PROBING_IMPORTS or name.startswith("dspark.host")}
    assert not imports, f"comm/ imports host-probing tools (move the probe to dspark.host): {imports}"
    paths = {f"{path.name}: {text[:60]!r}" for path in files for text in string_constants(path)
             if PROBED_PATHS.search(text)}
    assert not paths, f"comm/ reads /sys or /proc (move the probe to dspark.host): {paths}"
