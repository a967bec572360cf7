"""The ledger's hash chain: each forgery a reading of the lab found is reproduced, then caught."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

import pytest

from dspark.bench.analyse.analysis import annotate
from dspark.bench.ledger.chain import GENESIS, row_hash
from dspark.bench.ledger.ledger import Ledger, LedgerTampered
from dspark.bench.ledger.schema import CONTENT_COLUMNS, insert_measurement_sql, measurement_row
from dspark.bench.result import BenchResult
from dspark.cli.main import main
from tests.bench.factory import RUN_ROUNDS, append_run, make_measurement
from tests.messages import assert_line_names, assert_names


def _raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def _two_device(ledger: Ledger) -> BenchResult:
    return next(r for r in annotate(ledger.results(), history=ledger) if r.num_devices == 2)


def test_an_honest_ledger_verifies_and_names_its_head(tmp_path: Path) -> None:
    with Ledger(tmp_path / "l.sqlite") as ledger:
        assert ledger.verify().ok and ledger.verify().head == GENESIS
        append_run(ledger)
        report = ledger.verify()
        assert report.ok and report.rows == 2 * RUN_ROUNDS and report.head == ledger.head() != GENESIS
    assert main(["bench", "verify", "--db", str(tmp_path / "l.sqlite")]) == 0


def test_extra_rounds_with_fresh_ids_are_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
        honest = _two_device(ledger)
    # The finding: three more rounds of the 2-device configuration, fast ones, each with a fresh
    # id, inserted straight into the file, were read as more rounds and doubled the speedup.
    conn = _raw(db)
    columns = ", ".join(CONTENT_COLUMNS)
    for devices, steps in ((1, [[460.0] * 3]), (2, [[120.0] * 3] * 2)):
        template = conn.execute(f"SELECT {columns} FROM measurements WHERE num_devices = ? "
                                "ORDER BY id LIMIT 1", (devices,)).fetchone()
        for r in range(RUN_ROUNDS, 2 * RUN_ROUNDS):
            forged = {**json.loads(template[-1]), "round_index": r, "step_ms_by_rank": steps}
            mid = f"{template[2]}/{template[-2]}/r{r}"
            conn.execute(f"INSERT INTO measurements ({columns}) VALUES ({', '.join('?' * len(template))})",
                         (mid, *template[1:3], r, *template[4:-1], json.dumps(forged, sort_keys=True)))
    with Ledger(db) as ledger:
        unverified = _two_device(ledger)
        assert unverified.rounds == 2 * RUN_ROUNDS and unverified.speedup > 1.3 * honest.speedup
        report = ledger.verify()
        assert not report.ok and len(report.bad) == 2 * RUN_ROUNDS
        first = report.first_bad
        assert first is not None and first.row_id == 2 * RUN_ROUNDS + 1
        assert "no hash" in first.reason and "planned 3" in first.reason
        after = _two_device(ledger)  # verified: the forged rows are left out
    assert after.rounds == RUN_ROUNDS and after.speedup == pytest.approx(honest.speedup)
    assert main(["bench", "verify", "--db", str(db)]) == 1
    assert f"row {2 * RUN_ROUNDS + 1} (" in capsys.readouterr().err
    for action in (["report", "--run", "latest", "--report", str(tmp_path / "rep")],
                   ["export", "--run", "latest", "--json", str(tmp_path / "x.json")],
                   ["compare", "latest", "latest"]):
        assert main(["bench", *action, "--db", str(db)]) == 2
        assert f"row {2 * RUN_ROUNDS + 1}" in capsys.readouterr().err
    assert main(["bench", "list", "--db", str(db)]) == 0
    assert "TAMPERED" in capsys.readouterr().out


def test_a_rewrite_under_dropped_triggers_is_caught(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger, busy=True)
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
    for bad in report.bad:  # its content, not its link: the rows were rewritten in place
        assert_names(bad.reason, "content", "hash")
        assert "prev_hash" not in bad.reason


def test_a_deleted_row_breaks_the_next_link(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
    conn = _raw(db)
    conn.execute("DROP TRIGGER measurements_no_delete")
    conn.execute("DELETE FROM measurements WHERE id = 3")
    with Ledger(db) as ledger:
        report = ledger.verify()
    assert [bad.row_id for bad in report.bad] == [4]
    assert "row 2's hash" in report.bad[0].reason
    assert len(report.faults) == 1 and "'measurements_no_delete'" in report.faults[0]


def test_a_chained_row_whose_ids_lie_about_its_content_is_caught(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
        head = ledger.head()
    # A forger who computes the chain but files a 2-device measurement under another
    # configuration's hash, or a round the run never planned.
    lying = make_measurement(round_index=0, rounds_planned=RUN_ROUNDS, run_id="run-b")
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


def _downgrade(db: Path, *, edit: bool) -> None:
    """The finding: drop the hash columns, set the version back to 2 (and rewrite a row), so that
    DSpark would chain the file as it is now and `verify` pass."""
    conn = _raw(db)
    for name in ("measurements_no_update", "schema_version_no_delete", "seals_no_update",
                 "seals_no_delete", "seals_no_replace"):
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("DROP TABLE seals")
    conn.execute("ALTER TABLE measurements DROP COLUMN prev_hash")
    conn.execute("ALTER TABLE measurements DROP COLUMN row_hash")
    conn.execute("DELETE FROM schema_version WHERE version > 2")
    conn.execute("INSERT INTO schema_version VALUES (2, 'then')")
    if edit:
        row_id, text = conn.execute("SELECT id, measurement_json FROM measurements "
                                    "WHERE num_devices = 2 ORDER BY id LIMIT 1").fetchone()
        m = json.loads(text)
        m["step_ms_by_rank"] = [[120.0] * 3] * 2
        conn.execute("UPDATE measurements SET measurement_json = ? WHERE id = ?",
                     (json.dumps(m, sort_keys=True), row_id))
    conn.execute("CREATE TRIGGER measurements_no_update BEFORE UPDATE ON measurements "
                 "BEGIN SELECT RAISE(ABORT, 'append-only'); END")


def test_a_downgraded_ledger_is_refused_and_never_sealed_silently(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
        kept = ledger.head()
    _downgrade(db, edit=True)
    for command in (["verify"], ["list"], ["export", "--json", str(tmp_path / "x.json")]):
        assert main(["bench", *command, "--db", str(db)]) == 2
        err = capsys.readouterr().err
        assert_line_names(" ".join(err.split()), "schema 2", "no hash chain", "--seal")
    assert main(["bench", "verify", "--db", str(db), "--seal"]) == 0  # asked for: chained, recorded
    out = capsys.readouterr().out
    assert_line_names(" ".join(out.split()), "SEALED", "rows 1-6", "schema-2")
    with Ledger(db) as ledger:
        assert ledger.schema_version() == 4 and ledger.verify().ok
        assert [(seal.from_version, seal.rows) for seal in ledger.verify().seals] == [(2, 2 * RUN_ROUNDS)]
        ledger.append(make_measurement(run_id="run-c", rounds_planned=1))  # chained on the seal
    assert main(["bench", "verify", "--db", str(db)]) == 0
    assert "SEALED" in capsys.readouterr().out      # every verify reports it
    assert main(["bench", "verify", "--db", str(db), "--head", kept]) == 1   # the edit, caught
    assert_line_names(" ".join(capsys.readouterr().err.split()), "TAMPERED", kept, "no row's hash")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        _raw(db).execute("UPDATE measurements SET host = 'x'")


def test_a_resealed_ledger_without_edits_still_reaches_its_head(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
        kept = ledger.head()
    _downgrade(db, edit=False)
    with Ledger(db, seal=True) as ledger:
        report = ledger.verify(head=kept)
    assert report.ok and report.after_pinned == 0 and len(report.seals) == 1


@pytest.mark.parametrize("damage", ["tail row deleted", "chain recomputed", "rows appended"])
def test_verify_head_catches_deleted_and_rechained_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        damage: str) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
        kept = ledger.head()
    conn = _raw(db)
    if damage == "tail row deleted":   # the chain of what is left holds: only the head tells
        conn.execute("DROP TRIGGER measurements_no_delete")
        conn.execute(f"DELETE FROM measurements WHERE id = {2 * RUN_ROUNDS}")
        conn.execute("CREATE TRIGGER measurements_no_delete BEFORE DELETE ON measurements "
                     "BEGIN SELECT RAISE(ABORT, 'append-only'); END")
    elif damage == "chain recomputed":   # a row changed and every hash after it recomputed
        trigger = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'measurements_no_update'").fetchone()[0]
        conn.execute("DROP TRIGGER measurements_no_update")
        columns = ", ".join(CONTENT_COLUMNS)
        prev = GENESIS
        for row_id, *content in conn.execute(f"SELECT id, {columns} FROM measurements ORDER BY id").fetchall():
            if row_id == 2:
                m = json.loads(content[-1])
                m["step_ms_by_rank"] = [[120.0] * 3] * 2
                content[-1] = json.dumps(m, sort_keys=True)
            prev, new = prev, row_hash(prev, content)
            conn.execute("UPDATE measurements SET measurement_json = ?, prev_hash = ?, row_hash = ? "
                         "WHERE id = ?", (content[-1], prev, new, row_id))
            prev = new
        conn.execute(trigger)
    else:
        with Ledger(db) as ledger:
            ledger.append(make_measurement(run_id="run-c", rounds_planned=1))
    assert main(["bench", "verify", "--db", str(db)]) == 0   # the chain alone cannot tell
    capsys.readouterr()
    code = main(["bench", "verify", "--db", str(db), "--head", kept])
    out, err = capsys.readouterr()
    if damage == "rows appended":
        assert code == 0 and "1 row(s) appended since" in out
    else:
        assert code == 1
        assert_line_names(" ".join(err.split()), "TAMPERED", kept, "no row's hash")


def test_verify_head_takes_only_a_whole_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A shortened head (``make figures`` prints 16 digits) or a mistyped one is a usage error naming
    it, not a TAMPERED verdict on an intact ledger; case and blanks around a whole head are forgiven."""
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
        kept = ledger.head()
    for wrong in (kept[:16], "", "not-a-head", kept + "0"):
        assert main(["bench", "verify", "--db", str(db), "--head", wrong]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "TAMPERED" not in err
        assert_line_names(err, repr(wrong), "64 hex digits", "HEADS")
    assert main(["bench", "verify", "--db", str(db), "--head", f" {kept.upper()} "]) == 0
    assert "0 row(s) appended since" in capsys.readouterr().out


def test_a_crafted_ledger_is_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
    conn = _raw(db)
    conn.execute("DROP TRIGGER schema_version_no_delete")
    conn.execute("DELETE FROM schema_version")
    assert main(["bench", "verify", "--db", str(db)]) == 2
    assert_line_names(" ".join(capsys.readouterr().err.split()), "schema_version", "no version")
    conn.execute("INSERT INTO schema_version VALUES (4, 'now')")
    conn.execute("DROP TRIGGER measurements_no_delete")
    assert main(["bench", "verify", "--db", str(db)]) == 1
    assert_line_names(" ".join(capsys.readouterr().err.split()), "TAMPERED", "'measurements_no_delete'", "missing")
    conn.execute("ALTER TABLE measurements DROP COLUMN row_hash")
    assert main(["bench", "verify", "--db", str(db)]) == 2
    assert_line_names(" ".join(capsys.readouterr().err.split()), "'measurements'", "['row_hash']")
    conn.execute("DELETE FROM schema_version")   # a schema-2 file without its trigger, half-chained
    conn.execute("INSERT INTO schema_version VALUES (2, 'then')")
    conn.execute("DROP TRIGGER measurements_no_update")
    assert main(["bench", "verify", "--db", str(db), "--seal"]) == 2
    assert_line_names(" ".join(capsys.readouterr().err.split()), "altered outside DSpark")


def test_require_intact_names_only_the_runs_asked_for(tmp_path: Path) -> None:
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
    conn = _raw(db)
    conn.execute("DROP TRIGGER measurements_no_delete")
    conn.execute("DELETE FROM measurements WHERE id = 1")
    conn.execute("CREATE TRIGGER measurements_no_delete BEFORE DELETE ON measurements "
                 "BEGIN SELECT RAISE(ABORT, 'append-only'); END")
    with Ledger(db) as ledger:
        report = ledger.verify()
        ledger.require_intact(report, ["another-run"])
        with pytest.raises(LedgerTampered, match="row 2"):
            ledger.require_intact(report, ["run-a"])


def test_list_names_a_dropped_trigger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it said "0 row(s) fail the hash chain and are left out, first None" where a trigger was missing
    db = tmp_path / "ledger.db"
    Ledger(db).close()
    conn = sqlite3.connect(db)
    conn.execute("DROP TRIGGER measurements_no_update")
    conn.commit()
    conn.close()
    assert main(["bench", "list", "--db", str(db)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert_names(err, "TAMPERED", "'measurements_no_update'")
    assert "None" not in err and "0 row(s)" not in err, err
