"""Evaluation at any dataset length on HuggingFace GPT-2, BERT and Llama, every strategy, 2 ranks:
101 samples at a global batch of 20 leave rank 1 no sample of the last batch, which used to reach
the model as a batch of zero rows (GPT-2: ``cannot reshape tensor of 0 elements``). It gets a real
sample marked as padding now, and the gathered predictions and the reduced loss count each sample
once, as one process does. (3 samples on 4 ranks: tests/engine/test_four_ranks.py.)"""

from __future__ import annotations

import pytest

from tests.data import eval_lengths


@pytest.mark.parametrize("model", sorted(eval_lengths.MODELS))
def test_evaluation_counts_every_sample_once_as_one_process(pool, model: str, strategy: str) -> None:
    results = pool.run(eval_lengths.evaluate, model, strategy, 101, 20)
    eval_lengths.check(results, eval_lengths.reference(model, 101))
    assert [r["rows"][-1] for r in results] == [1, 1]  # rank 1's last batch: the padding sample
