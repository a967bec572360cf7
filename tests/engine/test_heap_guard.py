"""The heap guard (dspark.engine.heap_guard): it trims a heap that ratchets, within its margin, and
never a process whose growth is memory it allocated; the engine runs it after each optimizer step."""

from __future__ import annotations

import functools

import pytest
import torch

from dspark import cpu_malloc
from dspark.cpu_malloc import HeapUsage
from dspark.engine.heap_guard import GROWTH_FLOOR_BYTES, GROWTH_SHARE, SETTLE_STEPS, HeapGuard

MB = 1 << 20


def _run(readings: list[HeapUsage | None]) -> tuple[HeapGuard, list[int]]:
    """The guard over one reading per step from the step it first reads (SETTLE_STEPS); the steps
    after which it trimmed."""
    trimmed: list[int] = []
    feed = iter(readings)
    step = [0]
    guard = HeapGuard(read=lambda: next(feed), trim=lambda: trimmed.append(step[0]), rank=0)
    for step[0] in range(1, SETTLE_STEPS + len(readings)):
        guard.after_step()
    return guard, trimmed


def _usage(resident_mb: int, in_use_mb: int = 200, mapped_mb: int = 10, free_mb: int | None = None) -> HeapUsage:
    """By default all resident memory not allocated is the heap's free memory (a heap that ratchets)."""
    free_mb = resident_mb - in_use_mb - mapped_mb if free_mb is None else free_mb
    return HeapUsage(in_use_bytes=in_use_mb * MB, free_bytes=free_mb * MB, mapped_bytes=mapped_mb * MB,
                     resident_bytes=resident_mb * MB)


def test_a_heap_that_ratchets_is_trimmed_each_time_it_passes_the_margin() -> None:
    # 600 MB after the first step; the ratchet adds 40-60 MB unexplained at a time; after a trim the
    # next step touches only what it needs (back near 600), and the heap grows again. Its free memory
    # grows every step, trimmed or not (a trim gives back pages, not free blocks: measured on embed-tied
    # zero3, 2 ranks, by about 60 MB a step), so each pass is past the most it was trimmed at
    residents = [600, 640, 610, 650, 615, 660, 612]
    guard, trimmed = _run([_usage(r, free_mb=390 + 40 * k) for k, r in enumerate(residents)])
    margin = max(GROWTH_FLOOR_BYTES, 600 * MB * GROWTH_SHARE) / MB   # 16 MiB
    assert all(r - 600 > margin for r in residents[1::2])
    assert trimmed == [SETTLE_STEPS + 1, SETTLE_STEPS + 3, SETTLE_STEPS + 5]
    assert guard.trims == 3


def test_a_step_that_needs_more_after_a_trim_is_the_new_baseline_not_trimmed_again() -> None:
    # from the second step on, each step's transients really take 100 MB more (a longer sequence):
    # the step after the trim is still past the margin, so the guard keeps it as its baseline
    # instead of trimming (and faulting the pages in again) after every step
    guard, trimmed = _run([_usage(600)] + [_usage(700)] * 8)
    assert trimmed == [SETTLE_STEPS + 1] and guard.trims == 1
    # ... and measures the ratchet from there on
    guard, trimmed = _run([_usage(600), _usage(700), _usage(700), _usage(740)])
    assert trimmed == [SETTLE_STEPS + 1, SETTLE_STEPS + 3]


def _cycle(steps: int) -> tuple[HeapGuard, list[int]]:
    """The guard over a heap whose steps cycle through sequence lengths (heap_ratchet.py --vary-length):
    each step's transients take its share of 200 MB of heap; the heap keeps what the longest step
    needed as free memory (more after a full-length step: its top, as measured on hf-gpt2); its
    pages stay resident until a trim, after which a step touches only what it needs."""
    shares = (0.125, 1.0, 0.25, 0.75, 0.5, 1.0)
    touched_mb, trimmed, step = [0.0], [], [0]

    def read() -> HeapUsage:
        share = shares[(step[0] - 1) % len(shares)]
        touched_mb[0] = max(touched_mb[0], 200 * share)
        free_mb = 10 if step[0] == 1 else 215 if share == 1.0 else 190
        return _usage(round(610 + touched_mb[0]), free_mb=free_mb)

    def trim() -> None:
        touched_mb[0] = 0.0
        trimmed.append(step[0])

    guard = HeapGuard(read=read, trim=trim, rank=0)
    for step[0] in range(1, steps + 1):
        guard.after_step()
    return guard, trimmed


def test_a_workload_that_cycles_between_lengths_is_trimmed_in_its_first_cycle_only() -> None:
    # without recognising a level it trimmed before, the guard trimmed at every full-length step
    # (as it did on hf-gpt2 replicate, 2 ranks), each paying its pages' faults again
    guard, trimmed = _cycle(36)
    assert trimmed == [2] and guard.trims == 1


@pytest.mark.parametrize("grows", ["resident", "free"])
def test_a_level_past_what_was_trimmed_before_is_trimmed(grows: str) -> None:
    # trimmed at 700 MB with 490 MB free; back at that level the step is let be; past it by more than
    # the margin, in resident memory or in the heap's free memory, it is trimmed again
    more = 40 if grows == "resident" else 0
    readings = [_usage(600), _usage(700), _usage(610, free_mb=490), _usage(700, free_mb=490),
                _usage(700 + more, free_mb=490 + 40 - more)]
    _, trimmed = _run(readings)
    assert trimmed == [SETTLE_STEPS + 1, SETTLE_STEPS + 4]


def test_a_level_reached_while_the_heap_grew_is_not_kept() -> None:
    # trimmed at 700 MB with 490 MB free: the level; at 740 MB the heap had grown (500 MB free), so
    # that reading holds a ratchet's fresh pages: trimmed, and 730 MB later is past the level still
    readings = [_usage(600), _usage(700), _usage(610, free_mb=490), _usage(740, free_mb=500),
                _usage(605, free_mb=500), _usage(730, free_mb=500)]
    _, trimmed = _run(readings)
    assert trimmed == [SETTLE_STEPS + 1, SETTLE_STEPS + 3, SETTLE_STEPS + 5]


@pytest.mark.parametrize("grows", ["in_use", "mapped"])
def test_growth_the_process_allocated_is_never_trimmed(grows: str) -> None:
    # the heap's free memory grows as well, so that only what was allocated keeps the guard off
    readings = [_usage(600 + 80 * k, in_use_mb=200 + (80 * k if grows == "in_use" else 0),
                       mapped_mb=10 + (80 * k if grows == "mapped" else 0), free_mb=390 + 80 * k) for k in range(8)]
    guard, trimmed = _run(readings)
    assert trimmed == [] and guard.trims == 0


def test_growth_outside_the_heap_is_never_trimmed() -> None:
    # A growing Python cache of small objects lives in Python's own arenas, mapped apart from malloc:
    # resident grows, nothing mallinfo2 counts does, and the heap's free memory stays (measured: a
    # 2-rank loop adding 150k cache entries a step was trimmed after every step from step 6 on)
    readings = [_usage(600 + 80 * k, free_mb=390) for k in range(8)]
    guard, trimmed = _run(readings)
    assert trimmed == [] and guard.trims == 0


def test_the_margin_is_the_larger_of_the_floor_and_the_share() -> None:
    big = 2000  # MB: 2% of it (40 MB) is above the 16 MiB floor
    _, trimmed = _run([_usage(big), _usage(big + 35), _usage(big + 39)])
    assert trimmed == []
    _, trimmed = _run([_usage(big), _usage(big + 41)])
    assert trimmed == [SETTLE_STEPS + 1]
    _, trimmed = _run([_usage(300), _usage(300 + 16)])   # 2% is 6 MB: the floor holds
    assert trimmed == []
    _, trimmed = _run([_usage(300), _usage(300 + 17)])
    assert trimmed == [SETTLE_STEPS + 1]


def test_no_reading_turns_the_guard_off() -> None:
    calls = [0]

    def read() -> HeapUsage | None:
        calls[0] += 1
        return None

    guard = HeapGuard(read=read, trim=lambda: pytest.fail("trimmed"), rank=0)
    for _ in range(10):
        guard.after_step()
    assert guard.off and calls[0] == 1


@pytest.mark.parametrize("value", ["on", "off", "yes"])
def test_dspark_heap_guard_chooses(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setattr(cpu_malloc, "_state", cpu_malloc.CpuMalloc("tuned"))
    if value == "yes":
        with pytest.raises(ValueError, match="DSPARK_HEAP_GUARD='yes'"):
            cpu_malloc.guard_wanted({"DSPARK_HEAP_GUARD": value})
        return
    assert cpu_malloc.guard_wanted({"DSPARK_HEAP_GUARD": value}) is (value == "on")
    assert cpu_malloc.guard_wanted({}) is True
    for mode in ("heap", "lean"):   # the user's own choice: no guard
        monkeypatch.setattr(cpu_malloc, "_state", cpu_malloc.CpuMalloc(mode))
        assert cpu_malloc.guard_wanted({}) is False


def test_the_engine_runs_the_guard_after_each_optimizer_step(single_process: object,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import dspark

    residents = iter([600, 610, 700, 605, 605, 605, 605])   # MB read after steps 1..7: past the margin after step 3
    trimmed: list[int] = []
    monkeypatch.setattr(cpu_malloc, "guard_wanted", lambda env=None: True)
    monkeypatch.setattr(cpu_malloc, "heap_usage", lambda: _usage(next(residents)))
    monkeypatch.setattr(cpu_malloc, "release_freed", lambda: trimmed.append(engine.step_count))
    engine = dspark.Engine(torch.nn.Linear(4, 4), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    for _ in range(7):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    assert trimmed == [2]   # release_freed runs inside step 3, before step_count counts it
