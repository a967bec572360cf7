"""``dspark.preemption_requested()``: SIGTERM on any rank turns it True on every rank at the same
call; a handler the program installed keeps running; a program that never asks keeps SIGTERM's
default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType

import pytest

import dspark
from dspark.launch import preemption


def _answers(signal_rank: int, signal_call: int, calls: int) -> list[bool]:
    """Call preemption_requested() ``calls`` times; ``signal_rank`` gets SIGTERM just before call
    ``signal_call``."""
    answers = []
    try:
        for call in range(calls):
            if call == signal_call and dspark.get_world().rank == signal_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            answers.append(dspark.preemption_requested())
    finally:
        preemption._reset()
    return answers


@pytest.mark.parametrize("signal_rank", [0, 1])
def test_every_rank_sees_it_at_the_same_call(pool, signal_rank: int) -> None:
    want = [False] * 3 + [True] * 3  # and it stays True
    assert pool.run(_answers, signal_rank, 3, 6) == [want, want]


def _chained() -> tuple[bool, list[int]]:
    seen: list[int] = []

    def mine(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert not dspark.preemption_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        return dspark.preemption_requested(), seen
    finally:
        preemption._reset()
        assert signal.getsignal(signal.SIGTERM) is mine  # put back as it was
        signal.signal(signal.SIGTERM, before)


def test_the_programs_own_handler_still_runs(pool) -> None:
    assert pool.run(_chained) == [(True, [signal.SIGTERM])] * 2


def test_one_process_without_a_group(single_process) -> None:
    try:
        assert not dspark.preemption_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert dspark.preemption_requested()
    finally:
        preemption._reset()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_first_call_must_come_from_the_main_thread(single_process) -> None:
    errors: list[BaseException] = []

    def call() -> None:
        try:
            dspark.preemption_requested()
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


@pytest.mark.slow
def test_a_program_that_never_asks_still_terminates_on_sigterm() -> None:
    code = ("import os, signal, time, dspark\n"
            "dspark.init()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
