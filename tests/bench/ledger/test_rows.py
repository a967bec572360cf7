"""A kept artifact's ledger rows (``dspark bench export --rows``): read back as a ledger, verified
against a kept head, and refused when altered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.bench.ledger.ledger import Ledger
from dspark.bench.ledger.rows import MAX_ROWS_FILE_BYTES
from dspark.cli.main import main
from tests.bench.factory import RUN_ROUNDS, append_run
from tests.messages import assert_line_names


@pytest.fixture
def kept(tmp_path: Path) -> tuple[Path, str]:
    """A 3-round run's rows exported to ``ledger.jsonl``, and the head a run prints."""
    db = tmp_path / "l.sqlite"
    with Ledger(db) as ledger:
        append_run(ledger)
        head = ledger.head()
    rows = tmp_path / "ledger.jsonl"
    assert main(["bench", "export", "--db", str(db), "--rows", str(rows)]) == 0
    return rows, head


def test_the_rows_read_back_as_the_same_ledger(kept: tuple[Path, str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rows, head = kept
    lines = rows.read_text().splitlines()
    assert len(lines) == 1 + 2 * RUN_ROUNDS and json.loads(lines[0])["seals"] == []
    with Ledger(rows) as again, Ledger(tmp_path / "l.sqlite") as original:
        assert again.verify(head=head).ok and again.head() == head
        assert [r.to_dict() for r in again.results()] == [r.to_dict() for r in original.results()]
        with pytest.raises(ValueError, match="read-only"):
            again.append(original.measurements()[0])
    capsys.readouterr()
    assert main(["bench", "verify", "--db", str(rows), "--head", head]) == 0
    assert_line_names(" ".join(capsys.readouterr().out.split()), head, "pinned", "0 row(s) appended")
    assert main(["bench", "export", "--db", str(rows), "--json", str(tmp_path / "r.json")]) == 0


@pytest.mark.parametrize("damage", ["tail row deleted", "hashes dropped", "step edited", "too large"])
def test_an_altered_rows_file_is_refused(kept: tuple[Path, str], capsys: pytest.CaptureFixture[str],
                                         damage: str) -> None:
    rows, head = kept
    lines = rows.read_text().splitlines()
    if damage == "tail row deleted":
        lines = lines[:-1]
    elif damage == "hashes dropped":
        lines = [lines[0]] + [json.dumps({k: v for k, v in json.loads(line).items()
                                          if k not in ("prev_hash", "row_hash")}) for line in lines[1:]]
    elif damage == "step edited":
        row = json.loads(lines[2])
        m = json.loads(row["measurement_json"])
        m["step_ms_by_rank"] = [[100.0] * 3] * 2
        lines[2] = json.dumps({**row, "measurement_json": json.dumps(m, sort_keys=True)})
    rows.write_text("\n".join(lines) + "\n")
    if damage == "too large":
        with open(rows, "a") as out:
            out.truncate(MAX_ROWS_FILE_BYTES + 1)
    code = main(["bench", "verify", "--db", str(rows), "--head", head])
    err = capsys.readouterr().err
    if damage in ("hashes dropped", "too large"):   # not a rows file: one line, exit 2
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert_line_names(err, str(rows), *(["prev_hash"] if damage == "hashes dropped"
                                             else [str(MAX_ROWS_FILE_BYTES)]))
    else:
        assert code == 1
        assert_line_names(" ".join(err.split()), "TAMPERED", *([head] if damage == "tail row deleted" else
                                             ["row 2", "content", "hash"]))


def test_rows_are_exported_whole(kept: tuple[Path, str], tmp_path: Path) -> None:
    assert main(["bench", "export", "--db", str(tmp_path / "l.sqlite"), "--run", "latest",
                 "--rows", str(tmp_path / "part.jsonl")]) == 2
    assert main(["bench", "export", "--db", str(tmp_path / "l.sqlite"),
                 "--rows", str(tmp_path / "rows.json")]) == 2
