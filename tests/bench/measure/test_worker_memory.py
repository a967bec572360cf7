"""The CPU peak-memory measurement, validated on allocations whose sizes are known."""

from __future__ import annotations

import gc

import pytest
import torch

from dspark.bench.measure.memory import held_tensor_bytes, measure_peak_bytes, peak_of_running_sum

MB = 1_000_000


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_peak_of_running_sum() -> None:
    assert peak_of_running_sum([10, 5, -10, 20, -25]) == 25
    assert peak_of_running_sum([-5, 3]) == 0  # frees of older blocks never go below the start
    assert peak_of_running_sum([]) == 0


def test_held_bytes_count_storages_once_and_include_grads() -> None:
    gc.collect()
    before = held_tensor_bytes("cpu")
    block = _bytes(3 * MB)
    view = block[: MB]  # same storage: not counted again
    weight = torch.nn.Parameter(torch.zeros(MB // 4))  # 1 MB
    (weight * 2).sum().backward()  # its .grad (1 MB) has no Python object until read
    assert held_tensor_bytes("cpu") - before == 3 * MB + 2 * MB
    del block, view, weight


def test_measured_peak_matches_known_allocations() -> None:
    gc.collect()
    before = held_tensor_bytes("cpu")
    state = {"kept": _bytes(8 * MB)}

    def region() -> None:
        a = _bytes(10 * MB)
        b = _bytes(5 * MB)
        del a
        state["kept"] = None  # frees a block allocated before the region
        c = _bytes(20 * MB)
        state["kept"] = _bytes(8 * MB)  # live: b + c + kept = 33 MB, the peak
        del b, c

    peak = measure_peak_bytes(region, "cpu")
    assert peak - before == pytest.approx(33 * MB, rel=0.03)


def test_measured_peak_of_a_training_step_counts_state_and_activations() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1000, 1000, bias=False)          # 4 MB of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state
    inputs = torch.randn(500, 1000)                          # 2 MB

    def step() -> None:
        model(inputs).square().mean().backward()  # output 2 MB, grad 4 MB
        optimizer.step()
        optimizer.zero_grad()

    gc.collect()
    before = held_tensor_bytes("cpu")
    peak = measure_peak_bytes(step, "cpu")
    # At the end of backward the 4 MB gradient and at least one 2 MB activation gradient are
    # live on top of what was held; at most the four (500, 1000) tensors the step makes
    # (output, its square, and their gradients) can be live with it.
    assert before + 4 * MB + 2 * MB <= peak <= before + 4 * MB + 4 * 2 * MB


def test_other_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="'meta'"):
        measure_peak_bytes(lambda: None, "meta")


def test_peak_rss_covers_memory_touched_outside_tensors() -> None:
    import ctypes
    import mmap

    from dspark.bench.measure.memory import peak_rss_bytes, reset_peak_rss

    # Collect first, then reset: memory freed after the reset would lower the resident size under
    # the reset's mark, and the block below could grow back into it without a new peak.
    gc.collect()
    tensors_before = held_tensor_bytes("cpu")
    if not reset_peak_rss():
        pytest.skip("this kernel does not let a process reset its peak RSS")
    before = peak_rss_bytes()
    # 64 MB that no tensor owns: what a C++ buffer (DDP's reducer buckets) looks like to Python.
    # Fresh pages from the kernel (mmap), not malloc: with malloc tuned for training (an engine
    # built earlier in this process) a free heap, already resident, could serve it.
    block = mmap.mmap(-1, 64 * MB)
    view = (ctypes.c_char * (64 * MB)).from_buffer(block)
    ctypes.memset(ctypes.addressof(view), 1, 64 * MB)  # touched, so resident
    grown, tensors_grown = peak_rss_bytes() - before, held_tensor_bytes("cpu") - tensors_before
    del view
    block.close()
    assert 60 * MB <= grown <= 80 * MB
    assert tensors_grown < MB  # the tensor figure cannot see it; that is why both are recorded
