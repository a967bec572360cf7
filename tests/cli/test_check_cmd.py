"""`dspark check` on the command line: directories, exit codes and the summary line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dspark.cli.main import main
from tests.check.test_placement_rules import CLEAN, FIXTURES


def test_cli_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = tmp_path / "clean.py"
    clean.write_text(CLEAN)
    assert main(["check", str(clean)]) == 0
    assert capsys.readouterr().out.strip() == "no risky placements in 1 file"

    project = tmp_path / "project"
    for code, (source, _) in FIXTURES.items():
        (project / "pkg").mkdir(parents=True, exist_ok=True)
        (project / "pkg" / f"{code.lower()}.py").write_text(source)
    (project / ".venv" / "lib").mkdir(parents=True)
    (project / ".venv" / "lib" / "skipped.py").write_text(FIXTURES["DSP001"][0])
    assert main(["check", str(project), str(clean)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert sorted(line.split(": ")[1].split()[0] for line in out[:-1]) == sorted(FIXTURES)
    assert out[-1] == "6 errors, 2 warnings in 9 files"  # DSP000..005 errors, DSP006/7 warnings


def test_warnings_alone_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.py"
    path.write_text(FIXTURES["DSP006"][0])
    assert main(["check", str(path)]) == 0
    assert "DSP006" in capsys.readouterr().out


def test_missing_path_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope.py")]) == 2
    assert "nope.py" in capsys.readouterr().err


def test_a_fifo_or_device_is_not_a_regular_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    for path, kind in ((str(fifo), "a FIFO"), ("/dev/zero", "a device")):
        assert main(["check", path]) == 2
        err = capsys.readouterr().err
        assert path in err and "not a regular file" in err and kind in err, err
        assert "does not exist" not in err


def test_a_directory_is_walked_without_reading_what_is_not_a_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkfifo(tmp_path / "pipe.py")          # reading it would block forever
    (tmp_path / "pkg.py").mkdir()            # a directory named like a source file
    (tmp_path / "pkg.py" / "clean.py").write_text(CLEAN)
    assert main(["check", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "no risky placements in 1 file"
