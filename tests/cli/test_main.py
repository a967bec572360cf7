"""`dspark` as a whole: subcommand registration, exit codes, one-line errors without tracebacks."""

from __future__ import annotations

import importlib

import pytest

from dspark.cli.main import COMMAND_MODULES, build_parser, main
from tests.messages import assert_line_names


def test_every_command_module_registers_through_add_parser() -> None:
    for name in COMMAND_MODULES:
        assert callable(importlib.import_module(name).add_parser), name
    choices = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(choices) == {"env", "run", "bench", "check", "ckpt", "plan"}
    for command in ("env", "run", "check"):
        assert callable(choices[command].get_default("func")), command


@pytest.mark.parametrize("argv", [
    [],                                        # no subcommand
    ["frobnicate"],                            # unknown subcommand
    ["run", "--nproc", "two", "x.py"],         # argparse type error
    ["run", "x.py"],                           # --nproc missing
    ["run", "--nproc", "0", "x.py"],           # library ValueError
    ["run", "--nproc", "2", "no_such_script.py"],
    ["check", "no/such/dir"],
    ["env", "--bogus"],
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("dspark") and "Traceback" not in err


def test_error_messages_echo_the_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    main(["run", "--nproc", "2", "no_such_script.py"])
    assert "'no_such_script.py'" in capsys.readouterr().err
    main(["run", "--nproc", "0", "x.py"])
    assert "--nproc 0" in capsys.readouterr().err


def test_help_and_version_return_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert "dspark" in capsys.readouterr().out
    assert main(["run", "--help"]) == 0
    assert "--nproc" in capsys.readouterr().out


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only bad input becomes a one-liner; an unexpected error must stay loud.
    def broken(args: object) -> int:
        raise RuntimeError("internal bug")

    from dspark.cli import env_cmd

    monkeypatch.setattr(env_cmd, "run", broken)
    with pytest.raises(RuntimeError, match="internal bug"):
        main(["env"])


def test_run_errors_name_the_subcommand(capsys) -> None:
    from dspark.cli.main import main

    assert main(["run", "--nproc", "0", "x.py"]) == 2
    assert_line_names(capsys.readouterr().err, "dspark run: error:", "--nproc 0", ">= 1")
