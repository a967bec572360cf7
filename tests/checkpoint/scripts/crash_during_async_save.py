"""Save a checkpoint at step 1, then start an asynchronous save at step 2 and die (SIGKILL) while
its background thread is writing. Used by tests/checkpoint/test_async_save.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp

import dspark


def main(path: Path, writing: Path) -> None:
    dspark.init()
    torch.manual_seed(0)
    engine = dspark.Engine(torch.nn.Linear(4, 3), optimizer=lambda p: torch.optim.AdamW(p, lr=0.1),
                           strategy="zero1")
    for step in range(2):
        engine.backward(engine(torch.randn(8, 4)).square().mean())
        engine.step()
        if step == 0:
            engine.save(path)  # the checkpoint that must survive
    real_write = dcp.FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):  # type: ignore[no-untyped-def]
        done = real_write(self, plan, planner)  # the new shard file is on disk, .metadata is not
        writing.touch()
        time.sleep(600)
        return done

    with mock.patch.object(dcp.FileSystemWriter, "write_data", write_then_hang):
        engine.save(path, async_save=True)
        while not writing.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
