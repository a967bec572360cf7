"""The rules that say whether a measurement can be trusted: busy cores, a suspect baseline."""

from __future__ import annotations

from dspark.bench.analyse.trust import CORE_FOREIGN_ALLOWANCE, busy_machine, suspect_baseline
from tests.bench.factory import make_result
from tests.messages import assert_line_names


def test_a_busy_core_in_any_round_is_flagged_with_the_rounds() -> None:
    assert busy_machine(make_result(core_foreign_share_by_round=[0.02, 0.09, None])) == []
    (found,) = busy_machine(make_result(core_foreign_share_by_round=[0.02, 0.35, 0.18]))
    assert found["busy_rounds"] == [1, 2]
    assert_line_names(found["message"], "rounds 1, 2 of 3", "core", "35%", "other processes",
                      "stolen time", "10% allowed")
    assert CORE_FOREIGN_ALLOWANCE == 0.10


def test_unpinned_threads_are_flagged() -> None:
    (found,) = busy_machine(make_result(threads_unpinned=3))
    assert_line_names(found["message"], "3 thread(s)", "not pinned")


def test_suspect_baseline_only_above_n() -> None:
    one = make_result(round_step_ms=[250.0, 262.0])
    at_two = make_result(num_devices=2, speedup=2.0, speedup_min=1.9, speedup_max=2.05)
    assert suspect_baseline(at_two, one) == []
    a_round_above = make_result(num_devices=2, speedup=2.0, speedup_min=1.9, speedup_max=2.1)
    assert_line_names(suspect_baseline(a_round_above, one)[0]["message"], "a round at 2.10x")
    above = make_result(num_devices=2, speedup=2.2, speedup_min=2.1, speedup_max=2.3)
    (found,) = suspect_baseline(above, one)
    assert_line_names(found["message"], "above the 2x", "2 devices")
    assert_line_names(found["message"], "medians", "5%")
    assert suspect_baseline(above, None) == []


def test_perfect_scaling_within_the_rounds_spread_is_not_suspect() -> None:
    """Seen on a quiet machine: 2.00x with rounds 1.94x-2.04x is 2 devices scaling perfectly."""
    one = make_result(round_step_ms=[1602.0, 1650.0, 1560.0])
    straddling = make_result(num_devices=2, speedup=2.004, speedup_min=1.94, speedup_max=2.04)
    assert suspect_baseline(straddling, one) == []
    every_round_above = make_result(num_devices=2, speedup=2.04, speedup_min=2.02, speedup_max=2.06)
    assert [a["kind"] for a in suspect_baseline(every_round_above, one)] == ["suspect_baseline"]
    far_above_median = make_result(num_devices=2, speedup=2.1, speedup_min=1.98, speedup_max=2.2)
    assert [a["kind"] for a in suspect_baseline(far_above_median, one)] == ["suspect_baseline"]


def test_any_round_above_n_is_flagged_not_only_the_median() -> None:
    """The finding: rounds of 1.95x, 1.96x and 2.31x (median 1.96x) passed unflagged."""
    one = make_result(round_step_ms=[571.0, 600.0, 617.0])
    two = make_result(num_devices=2, speedup=1.96, speedup_min=1.95, speedup_max=2.31,
                      round_indices=[0, 1, 2], round_speedups=[1.95, 2.31, 1.96])
    (found,) = suspect_baseline(two, one)
    assert found["rounds_above"] == [1]
    assert_line_names(found["message"], "round 1", "2.31x", "median", "1.96x", "above the 2x")
    within = make_result(num_devices=2, speedup=1.96, speedup_min=1.95, speedup_max=2.05,
                         round_indices=[0, 1, 2], round_speedups=[1.95, 2.05, 1.96])
    assert suspect_baseline(within, one) == []   # 2.05x: perfect scaling within the margin


def test_a_baseline_whose_rounds_disagree_is_flagged_and_so_is_every_speedup_on_it() -> None:
    """The finding: the headline's gpt2-cpu 1-device rounds were 571, 905 and 617 ms."""
    unsteady = make_result(round_step_ms=[571.0, 905.0, 617.0], round_indices=[0, 1, 2])
    (found,) = suspect_baseline(unsteady, None)
    assert_line_names(found["message"], "571 ms", "905 ms", "617 ms", "58%", "30%")
    two = make_result(num_devices=2, speedup=1.9, speedup_min=1.8, speedup_max=1.95,
                      round_indices=[0, 1, 2], round_speedups=[1.8, 1.9, 1.95])
    (found,) = suspect_baseline(two, unsteady)
    assert_line_names(found["message"], "disagree", "1.90x", "58%")
    steady = make_result(round_step_ms=[571.0, 600.0, 617.0], round_indices=[0, 1, 2])
    assert suspect_baseline(steady, None) == [] and suspect_baseline(two, steady) == []
