"""`dspark check` on the command line: directories, exit codes and the summary line."""

from __future__ import annotations

import os
import sys
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


# -- one file never ends the run (see [Note: one file never ends the run] in dspark.check.driver)

def test_a_file_it_cannot_analyse_is_a_finding_and_the_others_are_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a_500_terms.py").write_text("a = 1\nb = " + " + ".join(["a"] * 500) + "\n"
                                             + FIXTURES["DSP001"][0])
    (tmp_path / "b_too_deep.py").write_text("a = 1\nb = " + "+".join(["a"] * 25_000) + "\n")
    (tmp_path / "c_too_deep_to_parse.py").write_text("b = " + "-" * 30_000 + "a\n")
    (tmp_path / "d_nul.py").write_bytes(b"a = 1\x00\n")
    (tmp_path / "e_plain.py").write_text(FIXTURES["DSP001"][0])
    assert main(["check", str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1].split()[0] for line in out[:-1]] == [
        "DSP001", "DSP000", "DSP000", "DSP000", "DSP001"], out  # 500 terms: analysed like any file
    assert "cannot analyse" in out[1] and "b_too_deep.py:1:1" in out[1], out
    assert "cannot parse" in out[2] and "cannot parse" in out[3] and "null bytes" in out[3], out
    assert out[-1] == "5 errors, 0 warnings in 5 files"
    assert sys.getrecursionlimit() < 20_000  # given back


def test_a_checker_failure_on_one_file_is_a_finding_on_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark.check import driver

    real = driver.check_source
    monkeypatch.setattr(driver, "check_source", lambda source, path: real(source, path) if path.endswith("fine.py")
                        else (_ for _ in ()).throw(TypeError("a rule's bug")))
    (tmp_path / "broken.py").write_text("x = 1\n")
    (tmp_path / "fine.py").write_text(FIXTURES["DSP001"][0])
    assert main(["check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "broken.py:1:1: DSP000 cannot analyse" in out and "TypeError: a rule's bug" in out, out
    assert "fine.py" in out and "DSP001" in out, out


@pytest.mark.parametrize("kind", ["symlink loop", "not a directory"])
def test_a_path_it_cannot_reach_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            kind: str) -> None:
    if kind == "symlink loop":
        (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
        (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
        path, words = tmp_path / "loop1", "symbolic link loop"
    else:
        (tmp_path / "file.py").write_text("x = 1\n")
        path, words = tmp_path / "file.py" / "inner.py", "Not a directory"
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(path) in err and words in err, err
