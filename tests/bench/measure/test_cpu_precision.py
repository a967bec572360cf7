"""The CPU precision rule: the preset's mixed precision only where this CPU computes it faster."""

from __future__ import annotations

import pytest

from dspark.bench.measure.cpu_precision import choose_cpu_precision
from tests.messages import assert_line_names, assert_names


def test_a_half_precision_this_cpu_runs_slower_falls_back_to_fp32() -> None:
    choice = choose_cpu_precision("bf16", {"fp32": 1.9, "bf16": 3.1})
    assert choice.precision == "fp32"
    assert_line_names(choice.reason, "bf16", "3.10 ms", "fp32", "1.90 ms")


def test_a_faster_half_precision_is_kept() -> None:
    assert choose_cpu_precision("bf16", {"fp32": 2.8, "bf16": 0.67}).precision == "bf16"
    assert choose_cpu_precision("fp16", {"fp32": 2.8, "fp16": 103.0}).precision == "fp32"


def test_without_timings_or_for_fp32_the_preset_stands() -> None:
    assert choose_cpu_precision("bf16", {}).precision == "bf16"
    assert choose_cpu_precision("fp32", {"fp32": 9.0, "bf16": 1.0}).precision == "fp32"


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        choose_cpu_precision("int8", {})
    assert_names(str(caught.value), "precision='int8'", "fp32, bf16, fp16")
