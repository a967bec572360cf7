"""The comm observer sees every collective start and every blocking wait, with its kind and label."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dspark import comm


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str | None]] = []

    def launch(self, kind: str, label: str | None, start: Callable[[], Any]) -> Any:
        self.events.append(("launch", kind, label))
        return start()

    def wait(self, kind: str, label: str | None, wait: Callable[[], None]) -> None:
        self.events.append(("wait", kind, label))
        wait()


def _observed_collectives() -> dict[str, Any]:
    recorder = Recorder()
    previous = comm.set_observer(recorder)
    try:
        t = torch.ones(4)
        handle = comm.all_reduce(t, async_op=True, label="dspark.bucket0.all_reduce")
        handle.wait()
        handle.wait()  # a second wait returns at once: not a wait any more
        comm.broadcast(t)
        out = torch.empty(comm.get_world().world_size, 4)
        comm.all_gather_into_tensor(out, t, label="dspark.gather.root")
    finally:
        assert comm.set_observer(previous) is recorder
    return {"events": recorder.events, "sum": t.tolist()}


def test_the_observer_sees_launches_and_waits_with_labels(pool) -> None:
    for result in pool.run(_observed_collectives):
        assert result["events"] == [
            ("launch", "all_reduce", "dspark.bucket0.all_reduce"),
            ("wait", "all_reduce", "dspark.bucket0.all_reduce"),
            ("launch", "broadcast", None), ("wait", "broadcast", None),
            ("launch", "all_gather", "dspark.gather.root"), ("wait", "all_gather", "dspark.gather.root"),
        ]
        assert result["sum"] == [2.0] * 4  # the collectives still did their work


def test_one_process_has_nothing_to_wait_for(single_process) -> None:
    result = _observed_collectives()
    assert [e[0] for e in result["events"]] == ["launch"] * 3
    assert comm.current_observer() is None
