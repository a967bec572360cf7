"""The rules that say whether a measurement can be trusted: busy cores, a suspect baseline."""

from __future__ import annotations

from dspark.bench.trust import CORE_FOREIGN_ALLOWANCE, busy_machine, suspect_baseline
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
    at_two = make_result(num_devices=2, speedup=2.0, speedup_min=1.9, speedup_max=2.1)
    assert suspect_baseline(at_two, one) == []
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
