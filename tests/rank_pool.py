"""A pool of real gloo ranks, started once per test session and reused by every distributed test.

Spawning two fresh processes costs seconds; a task on the running pool costs milliseconds. A task is
a module-level function (picklable by reference) that every rank runs; ``pool.run`` returns the
per-rank results in rank order, or fails the test with each failing rank's traceback.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
import zlib
from collections.abc import Callable
from typing import Any

NUM_RANKS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, sys_path: list[str], tasks: Any, results: Any) -> None:
    sys.path[:] = sys_path
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    import dspark
    from dspark import comm

    dspark.init(backend="gloo", timeout=60)
    # [Note: frozen heap] A full gc.collect() walks every object the process holds: with torch (and
    # dynamo, transformers) imported that is ~0.4 s, where a task on the tiny models takes ~20 ms.
    # gc.freeze() sets what exists now aside, so each task's collection below walks only what was
    # made since: the task's own garbage (an engine's reference cycles) is still freed before the
    # next task, and what survived a task (modules it imported, caches) is frozen with the rest.
    gc.freeze()
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        # Every task starts from its own generator state, one per rank: what it draws unseeded
        # differs between ranks (as two processes' batches do) and does not depend on the tests that
        # ran before it in this pool (a test alone and in the whole suite see the same numbers).
        base = getattr(fn, "func", fn)  # a functools.partial: its function's name
        name = f"{getattr(base, '__module__', '')}.{getattr(base, '__qualname__', '')}"
        torch.manual_seed(zlib.crc32(name.encode()) * 16 + rank)
        try:
            out = (True, fn(*args, **kwargs))
        except BaseException:
            out = (False, traceback.format_exc())
        comm.reset_stats()
        gc.collect()
        gc.freeze()  # see [Note: frozen heap]
        results.put((rank, task_id, *out))
    dspark.shutdown()


class RankPool:
    def __init__(self, num_ranks: int = NUM_RANKS) -> None:
        self.num_ranks = num_ranks
        self._ctx = mp.get_context("spawn")
        self._next_id = 0
        self._start()

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [self._ctx.Queue() for _ in range(self.num_ranks)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(target=_worker, daemon=True,
                              args=(r, self.num_ranks, port, list(sys.path), self._tasks[r], self._results))
            for r in range(self.num_ranks)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 180.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        self._next_id += 1
        task_id = self._next_id
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.num_ranks:
            try:
                rank, tid, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.restart()
                raise AssertionError(f"{fn.__name__}: ranks {sorted(set(range(self.num_ranks)) - set(got))} "
                                     f"did not finish within {timeout} s (pool restarted)") from None
            if tid == task_id:
                got[rank] = (ok, value)
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
        if failures:
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(failures))
        return [got[r][1] for r in range(self.num_ranks)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
