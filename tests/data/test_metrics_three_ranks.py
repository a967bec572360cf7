"""The evaluation of tests/data/test_metrics.py on 3 real ranks, where global batches of 64 split
22 + 21 + 21 and the last one (41 samples) 14 + 14 + 13: the gathered predictions are still one
process's, in order, and the reduced metrics its means. A pool of its own (the shared one has 2 ranks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.data.test_metrics import NUM_SAMPLES, _evaluate, _one_process
from tests.rank_pool import RankPool


@pytest.fixture(scope="module")
def pool3() -> Iterator[RankPool]:
    ranks = RankPool(3)
    yield ranks
    ranks.close()


@pytest.mark.slow
def test_three_ranks_gather_and_reduce_like_one_process(pool3: RankPool) -> None:
    ids, logits, metrics = _one_process()
    results = pool3.run(_evaluate)
    assert len(results) == 3
    for got_ids, got_logits, got, equal in results:
        assert torch.equal(got_ids, ids) and len(got_ids) == NUM_SAMPLES
        torch.testing.assert_close(got_logits, logits)
        for name in ("loss", "acc", "per_class"):
            torch.testing.assert_close(got[name], metrics[name].double(), rtol=1e-6, atol=1e-7)
        assert equal["rank"].item() == 1.0  # (0 + 1 + 2) / 3
