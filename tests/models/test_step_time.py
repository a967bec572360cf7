from __future__ import annotations

import pytest

from dspark.models import GPTConfig, LanguageModeling
from dspark.models.step_time import time_training_step
from tests.messages import assert_names

TINY = LanguageModeling(name="tiny", description="tiny", default_global_batch=4,
                        default_precision="fp32", seq_len=8,
                        model=GPTConfig(vocab_size=32, context_len=8, num_layers=1, num_heads=2,
                                        width=16))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_times_the_requested_number_of_steps(precision: str) -> None:
    t = time_training_step(TINY, precision=precision, warmup_steps=1, measure_steps=3)
    assert (t.workload, t.precision, t.global_batch) == ("tiny", precision, 4)
    assert len(t.step_ms) == 3 and all(ms > 0 for ms in t.step_ms)
    assert t.best_ms <= t.median_ms


def test_unknown_precision_is_rejected() -> None:
    with pytest.raises(ValueError) as caught:
        time_training_step(TINY, precision="fp8")
    assert_names(str(caught.value), "precision='fp8'", "'fp32'", "'bf16'", "'fp16'")
