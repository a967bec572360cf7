"""Provenance: the commit comes from where the package lives, not from the current directory."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
from pathlib import Path

import pytest
import torch

from dspark.bench.measure.provenance import collect_provenance, device_model, source_commit


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def package_in_repo(tmp_path: Path) -> Path:
    package = tmp_path / "repo" / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    repo = tmp_path / "repo"
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return package


def test_commit_and_dirty_flag_of_the_package_checkout(package_in_repo: Path) -> None:
    head = _git(package_in_repo, "rev-parse", "HEAD")
    assert source_commit(package_in_repo) == (head, False)
    (package_in_repo / "__init__.py").write_text("x = 2\n")
    assert source_commit(package_in_repo) == (head, True)


def test_untracked_package_inside_another_repo_has_no_commit(package_in_repo: Path) -> None:
    # e.g. a venv's site-packages inside some user repository
    other = package_in_repo.parent / "vendored"
    other.mkdir()
    (other / "__init__.py").write_text("")
    assert source_commit(other) == ("", False)


def test_no_checkout_gives_an_empty_commit(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text("")
    assert source_commit(tmp_path) == ("", False)


def test_collect_provenance_fields() -> None:
    prov = collect_provenance(device=torch.device("cpu"), backend="gloo")
    assert prov.torch_version == torch.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", prov.python_version)
    assert prov.device_model == device_model(torch.device("cpu")) != ""
    assert dt.datetime.fromisoformat(prov.timestamp).utcoffset() == dt.timedelta(0)
    assert prov.backend == "gloo" and prov.host
