from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import Iterator

import pytest

from tests.strategies import STRATEGIES

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def pool() -> Iterator[object]:
    """Two real gloo ranks, shared by the whole session (see tests/rank_pool.py)."""
    from tests.rank_pool import RankPool

    rank_pool = RankPool()
    yield rank_pool
    rank_pool.close()


@pytest.fixture(params=STRATEGIES)
def strategy(request: pytest.FixtureRequest) -> str:
    """Each of the engine's strategies in turn (tests/strategies.py): the one list every test uses.

    A test that covers only some of them parametrizes ``strategy`` itself, which overrides this.
    """
    return str(request.param)


@pytest.fixture
def single_process() -> Iterator[object]:
    """DSpark initialised as the world-size-1 stand-in in this (test) process."""
    import dspark

    # dspark.shutdown() collects garbage twice: over the whole heap of this process (torch, dynamo,
    # transformers) each takes ~0.4 s; frozen, only what was made since (see [Note: frozen heap] in
    # tests/rank_pool.py)
    gc.collect()
    gc.freeze()
    dspark.shutdown()
    world = dspark.init()
    yield world
    dspark.shutdown()


def pytest_configure(config: pytest.Config) -> None:
    # A test run started in the background of a script (`make test &`, nohup, some CI runners)
    # inherits SIGINT ignored, and so would every process the tests start; DSpark leaves an ignored
    # Ctrl-C alone on purpose (a background job's Ctrl-C is not for it), so the tests of Ctrl-C
    # would see none arrive and time out. The tests stand in for a terminal's foreground job: SIGINT
    # handled here, so the processes they start begin with it at its default (an exec resets a
    # handled signal, keeps an ignored one). A test of the ignored case ignores it itself.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # `nohup make test` inherits SIGHUP ignored in the same way, and a job started with it ignored
    # rightly outlives a hang-up, so the tests of a hang-up would see their jobs run on. A handler
    # that does nothing keeps this run alive through a hang-up (what nohup asked for) while the
    # processes the tests start begin with SIGHUP at its default, as a terminal's job would.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN):
        signal.signal(signal.SIGHUP, _outlive_hang_up)


def _outlive_hang_up(signum: int, frame: object) -> None:
    """SIGHUP in a test run started under nohup: nothing (see pytest_configure)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    # Everything collection imported lives until the session ends: set it aside from every later
    # collection (see [Note: frozen heap] in tests/rank_pool.py)
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    # `make test-quick` leaves out every test that needs real ranks: those marked slow (fresh
    # processes) and those that use the rank pool, marked here so that no test has to say it twice.
    for item in items:
        if "pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.pool)
    # [Note: long files first] `make test` hands its two workers a file at a time, in this order
    # (xdist's own reorder, by test count, is off): the files that launch processes take tens of
    # seconds each, and one of them handed out last left the other worker idle for a minute. Given
    # out first, they are evened out by the many short files after them. The sort is stable.
    launching = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in launching)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA devices")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
