"""dspark.print prints once (rank 0) or on every rank with a prefix; dspark.log_dir reads the job's
log directory; dspark.progress draws on rank 0's terminal only."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

import dspark


def _print_both_ways() -> tuple[str, str]:
    once, every = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(once):
        dspark.print("loss", 2.5)
    dspark.print("rows", 32, "\nsecond line", all_ranks=True, file=every)
    return once.getvalue(), every.getvalue()


def test_print_on_two_ranks(pool) -> None:
    (once0, every0), (once1, every1) = pool.run(_print_both_ways)
    assert (once0, once1) == ("loss 2.5\n", "")
    assert every0 == "[rank 0] rows 32 \n[rank 0] second line\n"
    assert every1 == "[rank 1] rows 32 \n[rank 1] second line\n"


def test_print_before_init_takes_the_launchers_rank(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    dspark.shutdown()
    monkeypatch.setenv("RANK", "1")
    dspark.print("hidden")
    dspark.print("shown", all_ranks=True)
    assert capsys.readouterr().out == "[rank 1] shown\n"


def test_log_dir_is_the_launchers_or_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DSPARK_LOG_DIR", raising=False)
    assert dspark.log_dir() is None
    monkeypatch.setenv("DSPARK_LOG_DIR", str(tmp_path))
    assert dspark.log_dir() == tmp_path


def test_progress_yields_everything_and_draws_only_when_asked(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    dspark.shutdown()
    assert list(dspark.progress(range(5))) == [0, 1, 2, 3, 4]  # pytest's stdout is not a TTY
    assert capsys.readouterr().out == ""
    assert list(dspark.progress(iter(range(3)), total=3, description="eval", enabled=True)) == [0, 1, 2]
    assert "eval" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    assert list(dspark.progress(range(2), enabled=True)) == [0, 1]
    assert capsys.readouterr().out == ""
