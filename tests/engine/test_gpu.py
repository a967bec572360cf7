"""CUDA checks, skipped where CUDA is absent (marked ``gpu``): the engine on a GPU in one process,
every strategy and precision (fp16 with loss scaling), on the single-process stand-in and on a real
one-rank NCCL group (so that every collective the engine issues goes through NCCL on CUDA tensors),
and the allocator-based peak memory of the benchmark."""

from __future__ import annotations

import functools
import gc
from collections.abc import Iterator

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


_PRECISIONS = [("fp32", 1e-5), ("bf16", 3e-2), ("fp16", 3e-3)]
_STRATEGIES = ["replicate", "zero1", "zero2", "zero3"]


def _train_tied_on_cuda(strategy: str, precision: str) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(tm.make("tied"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy, precision=precision)
    try:
        for step in range(3):
            x, y = (t.cuda() for t in tm.batch("tied", 8, step))
            engine.backward(tm.loss_fn("tied", engine(x), y))
            assert engine.step()
        return {k: v.cpu() for k, v in engine.full_state_dict().items()}
    finally:
        engine.close()


@pytest.mark.parametrize("strategy", _STRATEGIES)
@pytest.mark.parametrize("precision,tolerance", _PRECISIONS)
def test_engine_on_cuda_matches_cpu_reference(single_process, strategy: str, precision: str,
                                              tolerance: float) -> None:
    assert single_process.device.type == "cuda"
    state = _train_tied_on_cuda(strategy, precision)
    assert rel_error(state, reference_state("tied", 3)) <= tolerance


@pytest.fixture
def nccl_one_rank() -> Iterator[object]:
    """A real one-rank NCCL process group on GPU 0: the engine's collectives run through NCCL."""
    if "nccl" not in dspark.comm.available_backends():
        pytest.skip("this PyTorch has no NCCL")
    dspark.shutdown()
    world = dspark.init(backend="nccl")
    yield world
    gc.collect()  # no model may hold the process group when it is destroyed
    dspark.shutdown()


@pytest.mark.parametrize("strategy", _STRATEGIES)
@pytest.mark.parametrize("precision,tolerance", [_PRECISIONS[0], _PRECISIONS[2]])
def test_engine_over_nccl_matches_cpu_reference(nccl_one_rank, strategy: str, precision: str,
                                                tolerance: float) -> None:
    assert nccl_one_rank.backend == "nccl" and nccl_one_rank.device.type == "cuda"
    state = _train_tied_on_cuda(strategy, precision)
    assert rel_error(state, reference_state("tied", 3)) <= tolerance


def test_peak_memory_comes_from_the_cuda_allocator() -> None:
    from dspark.bench.memory import measure_peak_bytes

    device = torch.device("cuda", 0)

    def allocate() -> None:
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        del block

    assert measure_peak_bytes(allocate, device) >= 64 * 2**20
