"""A rank's predicted process peak (dspark.planner.process_memory, [Note: process memory]): on a CPU
the heap's share grows with a step's transients, not with the model state allocated once; on a GPU
the allocator's measured ratio applies as before; the heap's share follows what the step's transients
hold at most in the heap, not those the C library maps apart."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark.cpu_malloc import mmap_threshold_bytes
from dspark.planner import Interconnect, Probe, cost, model_shape
from dspark.planner.process_memory import (
    HEAP_SHARE,
    RANK_BYTES,
    STATE_HEAP_SHARE,
    process_peak_bytes,
    ratchet_step_bytes,
)

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


LINK = Interconnect(name="serial", bytes_per_s=1e9, latency_s=0.0, overlaps_compute=False, source="by hand")


def test_zero3_on_several_ranks_counts_one_steps_ratchet_of_a_storage_just_below_the_mapped_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # an embedding gathered whole at 3/4 of the mapped size: it and its gradient ratchet the heap by
    # two of them a step (measured on embed-tied zero3, 2 ranks, where the plan read 0.89 without it)
    limit = mmap_threshold_bytes()
    assert ratchet_step_bytes([limit - MB, MB]) == 2 * (limit - MB)
    assert ratchet_step_bytes([limit // 2 - 1, limit, MB]) == 0   # holes of their size, or mapped apart
    embedding = nn.Embedding(limit * 3 // 4 // 4096, 1024)
    shape = model_shape(nn.Sequential(embedding, nn.Linear(1024, 8)), (2, True))
    base = Probe.from_one_step(device="cpu", batch=8, forward_ms=10.0, backward_ms=20.0, optimizer_ms=4.0,
                               step_bytes=1e6, num_params=3, unit_bytes=[0, 1, 1])
    probe = Probe(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "process_baseline_bytes": BASE})

    def peak(strategy: str, ranks: int) -> int:
        row = cost.row_cost(shape=shape, probe=probe, strategy=strategy, num_ranks=ranks, micro_batch=8, passes=1,
                            bucket_mb=25.0, link=LINK)
        assert row.process_peak_bytes is not None
        return row.process_peak_bytes

    counted = {(s, n): peak(s, n) for s in ("zero2", "zero3") for n in (1, 2)}
    monkeypatch.setattr(cost, "ratchet_step_bytes", lambda storages: 0)
    assert counted[("zero3", 2)] - peak("zero3", 2) == 2 * embedding.weight.nbytes
    assert all(counted[key] == peak(*key) for key in [("zero2", 1), ("zero2", 2), ("zero3", 1)])


def test_transients_mapped_apart_take_no_heap_share() -> None:
    # 180 MB of transients at the peak, of which the heap held at most 30 MB at once (the rest a
    # language model's logits, mapped apart): only those 30 MB take the heap's share
    mapped = process_peak_bytes(200 * MB, device_type="cpu", num_ranks=1, baseline_bytes=BASE,
                                allocator_share=HEAP_SHARE, state_bytes=20 * MB, heap_transient_bytes=30 * MB)
    assert mapped is not None
    assert mapped - BASE - 200 * MB == round(30 * MB * HEAP_SHARE + 20 * MB * STATE_HEAP_SHARE)
    assert mapped < _cpu(200, state_mb=20)  # not measured: every transient at the peak is in the heap


class _WideThenNarrow(nn.Module):
    """One activation (and its gradient) of 2 MiB at a batch of 128, everything else below 1 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.wide, self.narrow = nn.Linear(16, 4096), nn.Linear(4096, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.narrow(self.wide(x))


@pytest.mark.parametrize("malloc, mapped_apart", [("lean", True), ("tuned", False)])
def test_the_probe_counts_in_the_heap_only_the_allocations_below_the_mmap_threshold(
        monkeypatch: pytest.MonkeyPatch, malloc: str, mapped_apart: bool) -> None:
    import dspark.planner.probe as probe_module
    from dspark.planner.probe import measure_probe

    # lean maps every allocation of 1 MiB and more apart, tuned only those of 32 MiB and more; the
    # probe reads the threshold from the setting, and this process's own thresholds stay as they are
    # (set once per process: a lean one would slow every later test of this worker)
    monkeypatch.setenv("DSPARK_CPU_MALLOC", malloc)
    monkeypatch.setattr(probe_module, "tune_for_training", lambda: None)
    batch = (torch.randn(128, 16, generator=torch.Generator().manual_seed(0)), torch.arange(128) % 4)
    probe = measure_probe(_WideThenNarrow(), batch, loss_fn=F.cross_entropy,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1), precision="fp32",
                          device=torch.device("cpu"), batches=(64, 128), units=[""], library_baseline=False)
    assert probe.heap_step_bytes is not None
    step, heap = probe.step_bytes.at(128), probe.heap_step_bytes.at(128)
    assert step > 2 * MB
    if mapped_apart:
        assert heap < 0.25 * step, (heap, step)
    else:
        assert heap == pytest.approx(step, rel=0.1)
