"""The ledger's hash chain: each forgery a reading of the lab found is reproduced, then caught."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest

from dspark.bench.analysis import annotate
from dspark.bench.ledger import Ledger, LedgerTampered
from dspark.bench.ledger_chain import GENESIS, row_hash
from dspark.bench.ledger_schema import CONTENT_COLUMNS, insert_measurement_sql, measurement_row
from dspark.bench.result import BenchResult
from dspark.cli.main import main
from tests.bench.factory import make_measurement
from tests.messages import assert_line_names

ROUNDS = 3


def _run(ledger: Ledger, *, busy: bool = False) -> None:
    """A 3-round run: 1 device at ~460 ms, 2 devices at ~240 ms, interleaved."""
    rows = []
    for r in range(ROUNDS):
        one = make_measurement(num_devices=1, round_index=r, rounds_planned=ROUNDS,
                               step_ms_by_rank=[[460.0 + r, 462.0, 461.0]],
                               rank_loads=make_measurement().rank_loads[:1],
                               batch={"samples_by_rank": [8], "identical_input_ranks": [],
                                      "replicated_modules": [], "replicated_module_count": 0},
                               state_held_by_rank=make_measurement().state_held_by_rank[:1],
                               state_expected_by_rank=make_measurement().state_expected_by_rank[:1],
                               tensor_peak_bytes_by_rank=[150_000_000],
                               rss_peak_bytes_by_rank=[500_000_000])
        loads = [dict(load, foreign_cpu_s=0.2 if busy else 0.004)
                 for load in make_measurement().rank_loads]
        two = make_measurement(round_index=r, rounds_planned=ROUNDS, rank_loads=loads,
                               step_ms_by_rank=[[240.0 + r, 241.0, 242.0]] * 2)
        rows += [one, two]
    ledger.append(rows)


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _two_device(ledger: Ledger) -> BenchResult:
    return next(r for r in annotate(ledger.results(), history=ledger) if r.num_devices == 2)


def test_an_honest_ledger_verifies_and_names_its_head(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.sqlite") as ledger:
        assert ledger.verify().ok and ledger.verify().head == GENESIS
        _run(ledger)
        report = ledger.verify()
        assert report.ok and report.rows == 2 * ROUNDS and report.head == ledger.head() != GENESIS
    assert main(["bench", "verify", "--db", str(tmp_path / "l.sqlite")]) == 0


def test_extra_rounds_with_fresh_ids_are_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        _run(ledger)
        honest = _two_device(ledger)
    # The finding: three more rounds of the 2-device configuration, fast ones, each with a fresh
    # id, inserted straight into the file, were read as more rounds and doubled the speedup.
    conn = _raw(db)
    columns = ", ".join(CONTENT_COLUMNS)
    for devices, steps in ((1, [[460.0] * 3]), (2, [[120.0] * 3] * 2)):
        template = conn.execute(f"SELECT {columns} FROM measurements WHERE num_devices = ? "
                                "ORDER BY id LIMIT 1", (devices,)).fetchone()
        for r in range(ROUNDS, 2 * ROUNDS):
            forged = {**json.loads(template[-1]), "round_index": r, "step_ms_by_rank": steps}
            mid = f"{template[2]}/{template[-2]}/r{r}"
            conn.execute(f"INSERT INTO measurements ({columns}) VALUES ({', '.join('?' * len(template))})",
                         (mid, *template[1:3], r, *template[4:-1], json.dumps(forged, sort_keys=True)))
    with Ledger(db) as ledger:
        unverified = _two_device(ledger)
        assert unverified.rounds == 2 * ROUNDS and unverified.speedup > 1.3 * honest.speedup
        report = ledger.verify()
        assert not report.ok and len(report.bad) == 2 * ROUNDS
        first = report.first_bad
        assert first is not None and first.row_id == 2 * ROUNDS + 1
        assert "no hash" in first.reason and "planned 3" in first.reason
        after = _two_device(ledger)  # verified: the forged rows are left out
    assert after.rounds == ROUNDS and after.speedup == pytest.approx(honest.speedup)
    assert main(["bench", "verify", "--db", str(db)]) == 1
    assert f"row {2 * ROUNDS + 1} (" in capsys.readouterr().err
    for action in (["report", "--run", "latest", "--report", str(tmp_path / "rep")],
                   ["export", "--run", "latest", "--json", str(tmp_path / "x.json")],
                   ["compare", "latest", "latest"]):
        assert main(["bench", *action, "--db", str(db)]) == 2
        assert f"row {2 * ROUNDS + 1}" in capsys.readouterr().err
    assert main(["bench", "list", "--db", str(db)]) == 0
    assert "TAMPERED" in capsys.readouterr().out


def test_a_rewrite_under_dropped_triggers_is_caught(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        _run(ledger, busy=True)
        honest = _two_device(ledger)
    assert "busy_machine" in {a["kind"] for a in honest.anomalies}
    # The finding: DROP TRIGGER, UPDATE, CREATE TRIGGER rewrote the steps and zeroed the
    # busy-machine evidence; the report then showed a better speedup and no anomaly.
    conn = _raw(db)
    trigger = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'measurements_no_update'").fetchone()[0]
    conn.execute("DROP TRIGGER measurements_no_update")
    rows = conn.execute("SELECT id, measurement_json FROM measurements WHERE num_devices = 2").fetchall()
    for row_id, text in rows:
        m = json.loads(text)
        m["step_ms_by_rank"] = [[235.0] * 3] * 2
        m["rank_loads"] = [dict(load, foreign_cpu_s=0.0) for load in m["rank_loads"]]
        conn.execute("UPDATE measurements SET measurement_json = ? WHERE id = ?",
                     (json.dumps(m, sort_keys=True), row_id))
    conn.execute(trigger)
    with Ledger(db) as ledger:
        forged = _two_device(ledger)
        assert forged.speedup > honest.speedup and not forged.anomalies  # the finding
        report = ledger.verify()
    assert [bad.row_id for bad in report.bad] == [row_id for row_id, _ in rows]
    assert all("does not match its hash" in bad.reason for bad in report.bad)


def test_a_deleted_row_breaks_the_next_link(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        _run(ledger)
    conn = _raw(db)
    conn.execute("DROP TRIGGER measurements_no_delete")
    conn.execute("DELETE FROM measurements WHERE id = 3")
    with Ledger(db) as ledger:
        report = ledger.verify()
    assert [bad.row_id for bad in report.bad] == [4]
    assert "row 2's hash" in report.bad[0].reason


def test_a_chained_row_whose_ids_lie_about_its_content_is_caught(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        _run(ledger)
        head = ledger.head()
    # A forger who computes the chain but files a 2-device measurement under another
    # configuration's hash, or a round the run never planned.
    lying = make_measurement(round_index=0, rounds_planned=ROUNDS, run_id="run-b")
    renamed = list(measurement_row(lying))
    renamed[CONTENT_COLUMNS.index("measurement_id")] = "run-b/0123456789abcdef/r9"
    misfiled = measurement_row(dataclasses.replace(lying, config_hash="0123456789abcdef"))
    beyond = measurement_row(dataclasses.replace(lying, round_index=7))
    conn = _raw(db)
    prev = head
    for row in (tuple(renamed), misfiled, beyond):
        conn.execute(insert_measurement_sql(), (*row, prev, row_hash(prev, row)))
        prev = row_hash(prev, row)
    with Ledger(db) as ledger:
        report = ledger.verify()
    reasons = [bad.reason for bad in report.bad]
    assert len(reasons) == 3
    assert_line_names(reasons[0], "id", "'run-b/0123456789abcdef/r9'", "content")
    assert_line_names(reasons[1], "config_hash", "'0123456789abcdef'", "configuration")
    assert_line_names(reasons[2], "round 7", "planned 3")


def test_a_schema_2_ledger_is_sealed_into_a_chain(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        _run(ledger)
    # Make it the layout of schema 2: no hash columns, version 2.
    conn = _raw(db)
    for name in ("measurements_no_update", "schema_version_no_delete"):
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("ALTER TABLE measurements DROP COLUMN prev_hash")
    conn.execute("ALTER TABLE measurements DROP COLUMN row_hash")
    conn.execute("DELETE FROM schema_version WHERE version = 3")
    conn.execute("INSERT INTO schema_version VALUES (2, 'then')")
    conn.execute("CREATE TRIGGER measurements_no_update BEFORE UPDATE ON measurements "
                 "BEGIN SELECT RAISE(ABORT, 'append-only'); END")
    with Ledger(db) as ledger:
        assert ledger.schema_version() == 3
        assert ledger.verify().ok and ledger.verify().rows == 2 * ROUNDS
        ledger.append(make_measurement(run_id="run-c", rounds_planned=1))  # chained on the seal
        assert ledger.verify().ok and ledger.verify().rows == 2 * ROUNDS + 1
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        _raw(db).execute("UPDATE measurements SET host = 'x'")


def test_require_intact_names_only_the_runs_asked_for(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        _run(ledger)
    conn = _raw(db)
    conn.execute("DROP TRIGGER measurements_no_delete")
    conn.execute("DELETE FROM measurements WHERE id = 1")
    with Ledger(db) as ledger:
        report = ledger.verify()
        ledger.require_intact(report, ["another-run"])
        with pytest.raises(LedgerTampered, match="row 2"):
            ledger.require_intact(report, ["run-a"])
