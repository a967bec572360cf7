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
from dspark.comm.world import choose_backend
from tests.engine import tiny_models as tm
from tests.engine.harness import OPTIMIZERS, reference_state, rel_error, train_reference

pytestmark = pytest.mark.gpu


def test_auto_backend_picks_nccl_with_a_gpu_per_rank() -> None:
    if "nccl" not in dspark.comm.available_backends():
        pytest.skip("this PyTorch has no NCCL")
    assert choose_backend("auto", local_world_size=1) == "nccl"


_PRECISIONS = [("fp32", 1e-5), ("bf16", 3e-2), ("fp16", 3e-3)]


def _train_tied_on_cuda(strategy: str, precision: str, *, optimizer: str = "adamw",
                        clip: float | None = None, norms: list[float] | None = None,
                        ) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(tm.make("tied"), optimizer=OPTIMIZERS[optimizer], strategy=strategy,
                           precision=precision, clip_grad_norm=clip)
    try:
        for step in range(3):
            x, y = (t.cuda() for t in tm.batch("tied", 8, step))
            engine.backward(tm.loss_fn("tied", engine(x), y))
            assert engine.step()
            if norms is not None:
                norms.append(engine.last_grad_norm)
        return {k: v.cpu() for k, v in engine.full_state_dict().items()}
    finally:
        engine.close()


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


@pytest.mark.parametrize("precision,tolerance", [_PRECISIONS[0], _PRECISIONS[2]])
def test_engine_over_nccl_matches_cpu_reference(nccl_one_rank, strategy: str, precision: str,
                                                tolerance: float) -> None:
    assert nccl_one_rank.backend == "nccl" and nccl_one_rank.device.type == "cuda"
    state = _train_tied_on_cuda(strategy, precision)
    assert rel_error(state, reference_state("tied", 3)) <= tolerance


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_clipping_on_cuda_matches_autocast_pytorch(single_process, strategy: str,
                                                   precision: str) -> None:
    # SGD (a wrong factor shows) clipped at 0.05, below every norm here: on a GPU the clip
    # coefficient stays on the device and the norm is read after the optimizer is queued
    norms: list[float] = []
    state = _train_tied_on_cuda(strategy, precision, optimizer="sgd", clip=0.05, norms=norms)
    want = train_reference("tied", 3, optimizer="sgd", clip=0.05, precision=precision)
    tolerance = 1.5e-2 if precision == "bf16" else 4e-3
    assert rel_error(state, want["state"]) <= tolerance
    assert norms == pytest.approx(want["norms"], rel=tolerance)


def test_an_fp16_overflow_on_cuda_skips_the_step_on_the_device(single_process,
                                                               strategy: str) -> None:
    from dspark.engine import LossScaler

    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy, precision="fp16",
                           loss_scaler=LossScaler(scale=2.0**10, growth_interval=2))

    def step(poison: bool) -> bool:
        x, y = (t.cuda() for t in tm.batch("mlp", 8, 0))
        loss = tm.loss_fn("mlp", engine(x), y)
        engine.backward(loss * float("inf") if poison else loss)
        return engine.step()

    assert step(False)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    state_before = [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()]
    assert step(True) is False
    assert engine.loss_scale == 2.0**9
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(a[k], v) for a, s in zip(state_before, engine.optimizer.state.values(),
                                                    strict=True) for k, v in s.items())
    assert engine.step_count == 1
    assert step(False) and step(False)
    assert engine.step_count == 3 and engine.loss_scale == 2.0**10
    engine.close()


def test_peak_memory_comes_from_the_cuda_allocator() -> None:
    from dspark.bench.measure.memory import measure_peak_bytes

    device = torch.device("cuda", 0)

    def allocate() -> None:
        block = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        del block

    assert measure_peak_bytes(allocate, device) >= 64 * 2**20
