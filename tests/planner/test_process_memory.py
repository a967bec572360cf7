"""A rank's predicted process peak (dspark.planner.process_memory, [Note: process memory]): on a CPU
the heap's share grows with a step's transients, not with the model state allocated once; on a GPU
the allocator's measured ratio applies as before."""

from __future__ import annotations

from dspark.planner.process_memory import HEAP_SHARE, RANK_BYTES, STATE_HEAP_SHARE, process_peak_bytes

MB = 1 << 20
BASE = 300 * MB


def _cpu(tensor_peak_mb: int, state_mb: int, mapped_mb: int = 0, num_ranks: int = 1) -> int:
    peak = process_peak_bytes(tensor_peak_mb * MB, device_type="cpu", num_ranks=num_ranks, baseline_bytes=BASE,
                              allocator_share=HEAP_SHARE, mapped_bytes=mapped_mb * MB, state_bytes=state_mb * MB)
    assert peak is not None
    return peak


def test_the_heap_share_follows_a_steps_transients_not_the_state_kept() -> None:
    # the same 200 MB tensor peak: mostly activations (one rank of a long sequence) or mostly
    # optimizer state (a wide MLP); the zoo measured the first's heap far above the second's
    activations = _cpu(200, state_mb=20) - BASE - 200 * MB
    state = _cpu(200, state_mb=180) - BASE - 200 * MB
    assert activations == round(180 * MB * HEAP_SHARE + 20 * MB * STATE_HEAP_SHARE)
    assert state == round(20 * MB * HEAP_SHARE + 180 * MB * STATE_HEAP_SHARE)
    assert activations > state


def test_state_mapped_apart_adds_nothing_and_transients_stay_in_the_heap() -> None:
    # 100 MB of the state in allocations the C library maps apart: only the 50 MB left of it in the
    # heap takes the state's share; the 50 MB of transients take theirs whatever is mapped
    extra = _cpu(200, state_mb=150, mapped_mb=100) - BASE - 200 * MB
    assert extra == round(50 * MB * HEAP_SHARE + 50 * MB * STATE_HEAP_SHARE)


def test_a_rank_of_several_adds_its_process_groups_bytes() -> None:
    assert _cpu(200, state_mb=100, num_ranks=2) - _cpu(200, state_mb=100) == RANK_BYTES


def test_without_a_state_every_tensor_in_the_heap_is_a_transient() -> None:
    assert _cpu(200, state_mb=0, mapped_mb=50) - BASE - 200 * MB == round(150 * MB * HEAP_SHARE)


def test_a_gpu_keeps_the_allocators_ratio_and_an_unmeasured_baseline_gives_none() -> None:
    gpu = process_peak_bytes(1000 * MB, device_type="cuda", num_ranks=8, baseline_bytes=BASE, allocator_share=0.1,
                             state_bytes=900 * MB)
    assert gpu == round(BASE + 1000 * MB * 1.1)
    assert process_peak_bytes(MB, device_type="cpu", num_ranks=1, baseline_bytes=0, allocator_share=0.5) is None
