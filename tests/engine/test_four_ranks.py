"""Four real gloo ranks (``dspark run --nproc 4``), beyond the 2-rank pool: the collectives give the
right chunk to each rank, and every strategy trains as one process on the same global batches, with
SGD (scale-sensitive) and AdamW, on a model whose shards are uneven over 4 ranks; HuggingFace models
evaluate 3 samples as one process, rank 3 running a padding sample instead of zero rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.data import eval_lengths
from tests.engine import loop_models as lm
from tests.engine.four_ranks_worker import OPTIMIZERS, STEPS, rowless_loss, rowless_model

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("four_ranks_worker.py")
N = 4
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("four") / "out.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", str(N),
                           "--oversubscribe", str(WORKER), str(out)], cwd=out.parent, env=env, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_collectives_hand_each_of_four_ranks_its_chunk(four_ranks: dict) -> None:
    got = four_ranks["collectives"]  # rank 0's view
    ranks_sum = sum(r + 1 for r in range(N))  # 10
    assert got["rs"] == [ranks_sum * v for v in (0.0, 1.0, 2.0)]  # chunk 0 of the sum
    assert got["rs_avg"] == [ranks_sum / N * v for v in (0.0, 1.0, 2.0)]
    assert got["gathered"] == [float(r) for r in range(N) for _ in range(2)]
    assert got["all_reduce"] == [float(sum(range(N)))] * 4


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_strategy_on_four_ranks_trains_as_one_process(four_ranks: dict, strategy: str,
                                                            optimizer: str) -> None:
    want = lm.reference(STEPS, OPTIMIZERS[optimizer])
    assert not torch.equal(want["embed.weight"], lm.build().embed.weight.detach())  # it trained
    got = four_ranks["states"][(strategy, optimizer)]
    assert lm.max_rel_error(got, want) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_rank_that_owns_no_row_trains_and_resumes_as_one_process(four_ranks: dict, strategy: str,
                                                                    optimizer: str) -> None:
    """Rank 3 holds no row of the 3-row parameters: its optimizer has nothing to update (it used to
    be refused as an empty parameter list), and the checkpoint in the middle carries no rows of it."""
    model = rowless_model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(2 * STEPS):
        opt.zero_grad()
        rowless_loss(model, step, split=False).backward()
        opt.step()
    want = {k: v.detach() for k, v in model.state_dict().items()}
    assert not torch.equal(want["0.weight"], rowless_model()[0].weight.detach())  # it trained
    assert lm.max_rel_error(four_ranks["rowless"][(strategy, optimizer)], want) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(eval_lengths.MODELS))
def test_three_samples_on_four_ranks_evaluate_as_one_process(four_ranks: dict, model: str,
                                                             strategy: str) -> None:
    result = four_ranks["eval"][(model, strategy)]
    eval_lengths.check([{**result, "rows": [r for ranks in result["rows"] for r in ranks]}],
                       eval_lengths.reference(model, 3))
    assert [ranks[-1] for ranks in result["rows"]] == [1, 1, 1, 1]  # rank 3: the padding sample
