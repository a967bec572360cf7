"""The accumulation window and its one averaging rule, with no process group."""

from __future__ import annotations

import pytest

from dspark.engine.window import StepWeights, Window, average_factor


def _weights(*, micro: int = 4, accum: int = 4, weight_sum: float | None = None,
             loss_scale: float = 1.0) -> StepWeights:
    return StepWeights(micro_steps=micro, accum_steps=accum, weight_sum=weight_sum, batch_size=8,
                       loss_scale=loss_scale)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_unweighted_windows_average_over_ranks_and_their_own_micro_batches(num_ranks: int) -> None:
    full = average_factor(_weights(), total_weight=None, num_ranks=num_ranks, pre_divided=False)
    assert full == pytest.approx(1.0 / num_ranks)
    cut_short = average_factor(_weights(micro=2), total_weight=None, num_ranks=num_ranks, pre_divided=False)
    assert cut_short == pytest.approx(2.0 / num_ranks)  # each backward scaled by 1/4, two of them ran


@pytest.mark.parametrize("num_ranks", [1, 2, 4])
def test_a_low_precision_wire_divided_already_and_the_factor_leaves_it_out(num_ranks: int) -> None:
    plain = average_factor(_weights(weight_sum=3.0), total_weight=12.0, num_ranks=num_ranks, pre_divided=False)
    wire = average_factor(_weights(weight_sum=3.0), total_weight=12.0, num_ranks=num_ranks, pre_divided=True)
    assert plain == pytest.approx(1.0 / 12.0)
    assert wire == pytest.approx(num_ranks / 12.0)
    assert average_factor(_weights(), total_weight=None, num_ranks=num_ranks, pre_divided=True) == 1.0


def test_fp16_divides_by_what_it_multiplied_and_no_weight_anywhere_skips() -> None:
    assert average_factor(_weights(loss_scale=1024.0), total_weight=None, num_ranks=2,
                          pre_divided=False) == pytest.approx(0.5 / 1024.0)
    assert average_factor(_weights(weight_sum=0.0), total_weight=0.0, num_ranks=2, pre_divided=False) is None


def test_one_rank_is_the_same_rule_with_a_world_size_of_one() -> None:
    # the single-rank path passes its own weight sum as the total
    assert average_factor(_weights(weight_sum=5.0), total_weight=5.0, num_ranks=1,
                          pre_divided=False) == pytest.approx(0.2)
    assert average_factor(_weights(micro=3), total_weight=None, num_ranks=1,
                          pre_divided=False) == pytest.approx(4.0 / 3.0)


def test_the_window_resets_to_empty_but_keeps_the_last_gradient_bytes() -> None:
    window = Window(micro_step=2, weight_sum=3.0, weight_unit=0.5, batch_size=8, synced=True,
                    grads_bytes_held=64)
    weights = window.step_weights(accum_steps=4, loss_scale=128.0)
    assert (weights.micro_steps, weights.weight_sum, weights.batch_size) == (2, 3.0, 8)
    assert weights.loss_scale == 64.0  # the loss scale times this rank's share
    assert window.step_weights(accum_steps=4, loss_scale=None).loss_scale == 1.0
    window.reset()
    assert (window.micro_step, window.weight_sum, window.weight_unit, window.batch_size,
            window.synced) == (0, None, None, None, False)
    assert window.grads_bytes_held == 64
