"""CUDA checks, skipped where CUDA is absent (marked ``gpu``): the engine on a GPU in one process,
fp16 with loss scaling, and the allocator-based peak memory of the benchmark."""

from __future__ import annotations

import functools

import pytest
import torch

import dspark
from dspark.comm.world import _choose_backend
from tests.engine import tiny_models as tm
from tests.engine.harness import reference_state, rel_error

pytestmark = pytest.mark.gpu


def test_auto_backend_picks_nccl_with_a_gpu_per_rank() -> None:
    if "nccl" not in dspark.comm.available_backends():
        pytest.skip("this PyTorch has no NCCL")
    assert _choose_backend("auto", local_world_size=1) == "nccl"


@pytest.mark.parametrize("precision,tolerance", [("fp32", 1e-5), ("bf16", 3e-2), ("fp16", 3e-3)])
def test_engine_on_cuda_matches_cpu_reference(single_process, precision: str, tolerance: float) -> None:
    assert single_process.device.type == "cuda"
    engine = dspark.Engine(tm.make("tied"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy="zero2", precision=precision)
    for step in range(3):
        x, y = (t.cuda() for t in tm.batch("tied", 8, step))
        engine.backward(tm.loss_fn("tied", engine(x), y))
        assert engine.step()
    state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    assert rel_error(state, reference_state("tied", 3)) <= tolerance


def test_peak_memory_comes_from_the_cuda_allocator() -> None:
    from dspark.bench.memory import measure_peak_bytes

    device = torch.device("cuda", 0)

    def allocate() -> None:
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        del block

    assert measure_peak_bytes(allocate, device) >= 64 * 2**20
