"""The step ratio of DSpark beside its peers: the median of per-round ratios, pairings, tables."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from rich.console import Console

from dspark.bench.analyse.peer_ratios import PAIRINGS, peer_ratios
from dspark.bench.measure.peers import DEEPSPEED_PEERS, PEERS, TORCH_PEERS
from dspark.bench.present.formatting import peer_rows
from dspark.bench.present.report import render_peer_table, write_html_report
from tests.bench.factory import make_result
from tests.messages import assert_line_names, assert_names


def _pair(ours_rounds: list[float], theirs_rounds: list[float], *, workload: str = "gpt2-cpu",
          ours: str = "replicate", theirs: str = "torch-ddp", devices: int = 2) -> list:
    return [make_result(workload=workload, num_devices=devices, strategy=ours,
                        step_ms=sorted(ours_rounds)[len(ours_rounds) // 2], round_step_ms=ours_rounds),
            make_result(workload=workload, num_devices=devices, strategy=theirs,
                        step_ms=sorted(theirs_rounds)[len(theirs_rounds) // 2],
                        round_step_ms=theirs_rounds)]


def test_every_peer_is_paired_with_the_strategy_that_does_its_job() -> None:
    assert {theirs for _, theirs in PAIRINGS} == set(PEERS)
    for ours, theirs in PAIRINGS:
        if theirs in TORCH_PEERS:
            assert TORCH_PEERS[theirs] == ours
        else:
            assert theirs in DEEPSPEED_PEERS and theirs.endswith(ours.removeprefix("zero"))


def test_ratio_is_the_median_of_per_round_ratios_not_of_pooled_medians() -> None:
    # the machine slows down in round 2; per round DSpark is 10%, 10% and 20% faster
    (r,) = peer_ratios(_pair([90.0, 180.0, 96.0], [100.0, 200.0, 120.0]))
    assert (r.ours, r.theirs, r.rounds) == ("replicate", "torch-ddp", 3)
    assert r.ratio == pytest.approx(0.9)
    assert (r.lowest, r.highest) == (pytest.approx(0.8), pytest.approx(0.9))
    assert r.lowest <= r.ratio <= r.highest
    assert r.verdict == "DSpark faster"
    assert (r.ours_ms, r.theirs_ms) == (96.0, 120.0)  # the results' own medians, shown beside it


def test_a_slower_dspark_reads_above_one() -> None:
    (r,) = peer_ratios(_pair([110.0, 121.0], [100.0, 110.0]))
    assert r.ratio == pytest.approx(1.1) and r.lowest == pytest.approx(1.1)
    assert r.verdict == "peer faster"


def test_rounds_on_both_sides_of_one_are_called_noise_not_a_win() -> None:
    (r,) = peer_ratios(_pair([90.0, 110.0, 99.0], [100.0, 100.0, 100.0]))
    assert r.ratio == pytest.approx(0.99) and r.verdict == "rounds disagree"
    (single,) = peer_ratios(_pair([90.0], [100.0]))
    assert single.verdict == "one round"


def test_rounds_pair_by_index_and_unpaired_results_are_left_out() -> None:
    ours, theirs = _pair([100.0, 50.0], [200.0, 100.0])
    shifted = make_result(**{**theirs.to_dict(), "round_indices": [1, 2], "round_step_ms": [100.0, 400.0]})
    (r,) = peer_ratios([ours, shifted])
    assert r.rounds == 1 and r.ratio == pytest.approx(0.5)  # only round 1 is in both
    alone = make_result(num_devices=2, strategy="zero2", workload="gpt2-cpu")
    no_rounds = make_result(**{**theirs.to_dict(), "strategy": "torch-fsdp2", "round_indices": [],
                               "round_step_ms": []})
    zero3 = make_result(num_devices=2, strategy="zero3", workload="gpt2-cpu")
    assert peer_ratios([alone, zero3, no_rounds]) == []


def test_one_device_and_other_workloads_do_not_pair() -> None:
    one_device = _pair([100.0], [120.0], devices=1)
    assert peer_ratios(one_device) == []
    assert len(peer_ratios(one_device, min_devices=1)) == 1
    mixed = [_pair([100.0], [120.0], workload="a")[0], _pair([100.0], [120.0], workload="b")[1]]
    assert peer_ratios(mixed) == []


def test_zero3_is_paired_with_both_its_peers_in_workload_order() -> None:
    results = (_pair([80.0], [100.0], workload="resnet50-cpu", ours="zero3", theirs="torch-fsdp2")
               + _pair([80.0], [160.0], workload="resnet50-cpu", ours="zero3",
                       theirs="deepspeed-zero3")[1:]
               + _pair([95.0], [100.0], workload="gpt2-cpu"))
    found = [(r.workload, r.ours, r.theirs, round(r.ratio, 3)) for r in peer_ratios(results)]
    assert found == [("resnet50-cpu", "zero3", "torch-fsdp2", 0.8),
                     ("resnet50-cpu", "zero3", "deepspeed-zero3", 0.5),
                     ("gpt2-cpu", "replicate", "torch-ddp", 0.95)]


def test_the_peer_table_in_the_terminal_and_the_html_report(tmp_path: Path) -> None:
    console = Console(record=True, width=250, color_system=None)
    assert render_peer_table(_pair([90.0, 180.0, 96.0], [100.0, 200.0, 120.0]), console)
    text = console.export_text()
    assert "DSpark beside its peers" in text and "0.900 (0.800-0.900)" in text
    assert "DSpark faster" in text
    assert_names(" ".join(text.split()), "median", "per-round ratios")
    quiet = Console(record=True, width=250, color_system=None)
    assert not render_peer_table([make_result()], quiet) and quiet.export_text() == ""
    page = write_html_report(_pair([90.0, 180.0, 96.0], [100.0, 200.0, 120.0]), tmp_path).read_text()
    assert "<h2>DSpark beside its peers</h2>" in page and "0.900 (0.800-0.900)" in page
    assert "DSpark beside its peers" not in write_html_report([make_result()], tmp_path / "b").read_text()


def test_results_of_two_runs_are_never_paired() -> None:
    # The finding: after a second run of DSpark alone into the same ledger, this run's DSpark was
    # paired with the earlier run's DDP (0.949 became 0.648, "DSpark faster").
    peers_run = [dataclasses.replace(r, run_id="peers-run") for r in _pair([95.0, 100.0], [100.0, 100.0])]
    again = dataclasses.replace(_pair([65.0, 64.0], [1.0, 1.0])[0], run_id="dspark-again")
    (honest,) = peer_ratios(peers_run)
    assert honest.run_id == "peers-run" and honest.ratio == pytest.approx(0.975)
    with pytest.raises(ValueError, match="2 runs \\(peers-run, dspark-again\\)"):
        peer_ratios([*peers_run, again])


def test_a_ratio_on_an_untrustworthy_side_says_so_in_both_tables(tmp_path: Path) -> None:
    # The finding: a 0.949 ratio built from results all flagged busy_machine ("not trustworthy")
    # was printed without a caveat.
    busy = {"kind": "busy_machine", "message": "in round 0, a rank's core spent up to 29% ..."}
    ours, theirs = _pair([95.0, 90.0], [100.0, 100.0])
    flagged = [dataclasses.replace(ours, anomalies=[busy]),
               dataclasses.replace(theirs, injected_faults={"DSPARK_BENCH_SLOW_RANK": "1:100"})]
    (ratio,) = peer_ratios(flagged)
    assert ratio.untrustworthy == ("DSpark busy_machine",
                                   "peer injected DSPARK_BENCH_SLOW_RANK=1:100")
    (row,) = peer_rows(flagged)
    assert "NOT TRUSTWORTHY" in row[9] and row[10] == "busy_machine"
    assert row[11] == "injected DSPARK_BENCH_SLOW_RANK=1:100"
    console = Console(record=True, width=400)
    render_peer_table(flagged, console)
    assert_line_names(console.export_text(), "NOT TRUSTWORTHY", "DSpark", "busy_machine")
    page = write_html_report(flagged, tmp_path / "report").read_text()
    assert "NOT TRUSTWORTHY" in page and "busy_machine" in page
    (clean,) = peer_rows(_pair([95.0, 90.0], [100.0, 100.0]))
    assert "NOT TRUSTWORTHY" not in clean[9] and clean[10:] == ["-", "-"]
