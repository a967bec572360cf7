"""docs/figures.md and the README's headline table come from kept artifacts, number for number."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.bench import record as record_module
from dspark.bench.artifacts.kept import ArtifactRefused, pin_artifact, read_heads
from dspark.bench.artifacts.table import load_table, write_table
from dspark.bench.figures import (
    HEADLINE_END,
    HEADLINE_START,
    headline_block,
    load_artifacts,
    main,
    render_figures,
    replace_headline,
    unsupported_numbers,
)
from tests.messages import assert_line_names, assert_names

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def artifacts():
    return load_artifacts(ROOT / "benchmarks" / "results")


def test_docs_figures_is_what_the_artifacts_give(artifacts):
    assert artifacts, "no benchmarks/results/*/artifact.json"
    assert (ROOT / "docs" / "figures.md").read_text() == render_figures(artifacts), \
        "docs/figures.md differs from the artifacts: run `make figures`"


def test_readme_headline_is_what_the_artifacts_give(artifacts):
    readme = (ROOT / "README.md").read_text()
    assert readme == replace_headline(readme, headline_block(artifacts)), \
        "README.md's headline table differs from the artifacts: run `make figures`"


def test_every_number_in_the_tables_is_in_an_artifact(artifacts):
    readme = (ROOT / "README.md").read_text()
    headline = readme[readme.index(HEADLINE_START):readme.index(HEADLINE_END)]
    assert unsupported_numbers((ROOT / "docs" / "figures.md").read_text(), artifacts) == []
    assert unsupported_numbers(headline, artifacts) == []


def test_a_hand_edited_number_is_caught(artifacts):
    text = render_figures(artifacts)
    row = next(line for line in text.splitlines() if line.startswith("| ") and "x" in line
               and not line.startswith("| workload"))
    step = row.split(" | ")[6].split(" ")[0]                      # the median step, e.g. "85.1"
    edited = text.replace(row, row.replace(f"| {step} (", f"| {float(step) * 0.9:.1f} (", 1))
    assert edited != text
    assert unsupported_numbers(edited, artifacts) == [f"{float(step) * 0.9:.1f}"]


def _keep(results: Path, name: str, meta: dict, *, pin: bool = True) -> Path:
    """Write ``results/name/artifact.json`` (title, command, commit, machine filled in) and pin it."""
    (results / name).mkdir(parents=True, exist_ok=True)
    (results / name / "artifact.json").write_text(json.dumps(
        {"title": "t", "command": "c", "commit": "x", "machine": "m", **meta}))
    if pin:
        pin_artifact(results, name)
    return results / name


def test_an_artifact_naming_a_missing_file_is_refused(tmp_path):
    _keep(tmp_path, "2026-01-01-box", {"results": ["gone.json"]}, pin=False)
    (tmp_path / "HEADS").write_text(f"{'0' * 64}  2026-01-01-box\n")
    with pytest.raises(ValueError, match=r"2026-01-01-box: file 'gone\.json'"):
        load_artifacts(tmp_path)


def _repo_with(tmp_path: Path, *names: str) -> Path:
    """A repository root holding copies of the kept artifacts ``names``, their heads, a README."""
    results = tmp_path / "benchmarks" / "results"
    heads = read_heads(ROOT / "benchmarks" / "results")
    for name in names:
        shutil.copytree(ROOT / "benchmarks" / "results" / name, results / name)
    (results / "HEADS").write_text("".join(f"{heads[n]}  {n}\n" for n in names))
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# R\n\n{HEADLINE_START}\n{HEADLINE_END}\n")
    return tmp_path


QUICK = "2026-12-05-xeon-2vcpu-quick-quiet"


def test_a_forged_results_json_is_refused_by_make_figures(tmp_path, capsys):
    """The finding: gpt2-cpu's 1-device step set to 517.4 ms, below its own p10 of 569.1, and a 2.10x
    speedup that its steps do not give, went into the README with every figures test green."""
    root = _repo_with(tmp_path, QUICK)
    assert main(["--root", str(root)]) == 0
    capsys.readouterr()
    path = root / "benchmarks" / "results" / QUICK / "results.json"
    rows = json.loads(path.read_text())
    for row in rows:
        if row["workload"] == "gpt2-cpu":
            row.update({"step_ms": 517.4} if row["num_devices"] == 1 else {"speedup": 2.10})
    path.write_text(json.dumps(rows, indent=1))
    before = (root / "README.md").read_text()
    assert main(["--root", str(root)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert (root / "README.md").read_text() == before    # nothing written
    assert_line_names(err, f"REFUSED {QUICK}", "results.json#3", "content", "chain.txt")
    assert_line_names(err, "step_ms 517.4", "p10-p90 (569.1-917.0)")
    assert_line_names(err, "speedup 2.1", "1.8592")


@pytest.mark.parametrize("damage", ["cell edited", "row removed", "head changed"])
def test_a_changed_table_is_refused_by_name(tmp_path, damage):
    directory = _keep(tmp_path, "2026-01-01-box", {"tables": ["table.json"]}, pin=False)
    write_table(directory, columns=["a", "b s"], rows=[["x", 1.5], ["y", 2.5]])
    pin_artifact(tmp_path, "2026-01-01-box")
    assert [t.rows for t in load_artifacts(tmp_path)[0].tables] == [(("x", "1.50"), ("y", "2.50"))]
    if damage == "head changed":
        (tmp_path / "HEADS").write_text(f"{'1' * 64}  2026-01-01-box\n")
        match = "pins 1111"
    else:
        rows = [["x", 1.5]] if damage == "row removed" else [["x", 1.5], ["y", 2.0]]
        write_table(directory, columns=["a", "b s"], rows=rows)
        match = "added or removed" if damage == "row removed" else r"table\.json#2: its content does not match"
    with pytest.raises(ArtifactRefused, match=rf"2026-01-01-box: .*{match}"):
        load_artifacts(tmp_path)


def test_a_ledger_artifact_renders_its_rows_and_refuses_a_deleted_tail_row(tmp_path):
    from dspark.bench.ledger.ledger import Ledger
    from tests.bench.factory import append_run

    directory = _keep(tmp_path / "results", "2026-01-01-box-quick", {"ledger": "ledger.jsonl"}, pin=False)
    with Ledger(tmp_path / "l.sqlite") as ledger:
        append_run(ledger)
        ledger.export_rows(directory / "ledger.jsonl")
        head = ledger.head()
    assert pin_artifact(tmp_path / "results", "2026-01-01-box-quick") == head
    (artifact,) = load_artifacts(tmp_path / "results")
    assert artifact.verified == "6 ledger rows" and artifact.head == head
    assert [r["num_devices"] for r in artifact.rows] == [1, 2] and artifact.rows[1]["speedup"] > 1.8
    lines = (directory / "ledger.jsonl").read_text().splitlines()
    (directory / "ledger.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ArtifactRefused) as refused:
        load_artifacts(tmp_path / "results")
    assert_line_names(str(refused.value), "2026-01-01-box-quick", head)


def test_a_pinned_head_is_never_changed_nor_an_artifact_removed(tmp_path):
    directory = _keep(tmp_path, "2026-01-01-box", {"tables": ["table.json"]}, pin=False)
    write_table(directory, columns=["a"], rows=[["1"]])
    pin_artifact(tmp_path, "2026-01-01-box")
    write_table(directory, columns=["a"], rows=[["2"]])
    with pytest.raises(ValueError, match="already pinned"):
        pin_artifact(tmp_path, "2026-01-01-box")
    shutil.rmtree(directory)
    with pytest.raises(ArtifactRefused) as refused:
        load_artifacts(tmp_path)
    assert_line_names(str(refused.value), "2026-01-01-box", "HEADS")


def heads_history(root: Path) -> list[tuple[str, str]]:
    """``(commit, HEADS as it was then)`` for every commit that touched ``root``'s
    benchmarks/results/HEADS. Skips outside a git checkout; a shallow clone fetches the rest of its
    history first (or skips, naming why, where its origin cannot give it)."""
    git = ["git", "-C", str(root)]
    try:
        shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True,
                                 text=True, check=True).stdout.strip()
        commits = subprocess.run([*git, "log", "--format=%H", "--", "benchmarks/results/HEADS"],
                                 capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    if shallow == "true":  # a cut history would hide a head changed in the one commit it shows
        fetched = subprocess.run([*git, "fetch", "-q", "--unshallow"], capture_output=True, text=True)
        if fetched.returncode != 0:
            pytest.skip(f"{root} is a shallow clone whose origin cannot give the rest of its history "
                        f"({fetched.stderr.strip()[:200]}): run git fetch --unshallow to check the pinned heads")
        commits = subprocess.run([*git, "log", "--format=%H", "--", "benchmarks/results/HEADS"],
                                 capture_output=True, text=True, check=True).stdout.split()
    return [(commit, subprocess.run([*git, "show", f"{commit}:benchmarks/results/HEADS"],
                                    capture_output=True, text=True, check=True).stdout)
            for commit in commits]


def test_no_head_in_git_history_was_ever_changed():
    """Every head HEADS ever pinned, in every commit that touched it, is still pinned as it was."""
    now = read_heads(ROOT / "benchmarks" / "results")
    changed = []
    for commit, text in heads_history(ROOT):
        for line in text.splitlines():
            head, _, name = line.partition("  ")
            if now.get(name) != head:
                changed.append(f"{commit[:12]}: {name} pinned {head[:16]}, now {now.get(name)}")
    assert changed == []


def test_the_history_check_reads_a_shallow_clone_whole(tmp_path):
    """A re-pinned head committed alone, cloned with --depth 1, would show no older HEADS to differ
    from: the check reads the whole history."""
    repo, git = tmp_path / "repo", ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "benchmarks" / "results").mkdir(parents=True)
    for head in ("a", "b"):
        (repo / "benchmarks" / "results" / "HEADS").write_text(f"{head * 64}  2026-01-01-box\n")
        subprocess.run([*git, "init", "-q", str(repo)], check=True)
        subprocess.run([*git, "-C", str(repo), "add", "-A"], check=True)
        subprocess.run([*git, "-C", str(repo), "commit", "-qm", head], check=True)
    assert len(heads_history(repo)) == 2
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(tmp_path / "shallow")],
                   check=True)
    assert len(heads_history(tmp_path / "shallow")) == 2


def _quick_artifact(results: Path, name: str, *, cores: int = 2, load: float = 0.5,
                    foreign: float = 0.01) -> None:
    from dspark.bench.analyse.analysis import annotate
    from tests.bench.factory import make_result

    rows = [r.to_dict() for r in annotate([
        make_result(core_foreign_share_by_round=[foreign] * 3),
        make_result(num_devices=2, step_ms=130.0, core_foreign_share_by_round=[foreign] * 3)])]
    (results / name).mkdir(parents=True)
    (results / name / "results.json").write_text(json.dumps(rows))
    (results / name / "output.txt").write_text(f"$ uptime\n load average: {load}, 1.0, 1.0\n")
    _keep(results, name, {"results": ["results.json"], "command": "dspark bench --suite quick",
                          "machine": f"Some CPU (x86_64), {cores} logical cores, 8.0 GiB, no GPU"})


def test_the_headline_is_the_newest_quiet_quick_suite_on_the_reference_machine(tmp_path):
    _quick_artifact(tmp_path, "2026-01-01-a")
    _quick_artifact(tmp_path, "2026-01-02-busy", foreign=0.5)        # flagged busy_machine
    _quick_artifact(tmp_path, "2026-01-03-loaded", load=3.5)          # load above its 2 cores
    _quick_artifact(tmp_path, "2026-01-04-bigger", cores=16)          # not the reference machine
    block = headline_block(load_artifacts(tmp_path))
    assert_line_names(block, "Some CPU", "2 logical cores", "benchmarks/results/2026-01-01-a/")
    _quick_artifact(tmp_path, "2026-01-05-b")
    assert "benchmarks/results/2026-01-05-b/" in headline_block(load_artifacts(tmp_path))


def test_a_table_artifact_is_rendered_and_its_numbers_are_known(tmp_path):
    run = tmp_path / "2026-01-01-box-startup"
    write_table(run, columns=["command", "exit s"], rows=[["`dspark run`", 1.234]], caption="median of 5")
    _keep(tmp_path, run.name, {"title": "Start-up", "anchor": "startup-time", "tables": ["table.json"]})
    artifacts = load_artifacts(tmp_path)
    text = render_figures(artifacts)
    assert '<a id="startup-time"></a>' in text and "| `dspark run` | 1.23 |" in text
    assert unsupported_numbers(text, artifacts) == []
    assert unsupported_numbers(text.replace("| 1.23 |", "| 1.03 |"), artifacts) == ["1.03"]
    assert "re-measure with `.venv/bin/python benchmarks/startup_time.py" not in text  # kept now


def test_the_newest_of_two_artifacts_with_one_anchor_keeps_it(tmp_path):
    for name in ("2026-01-01-a", "2026-01-02-b"):
        write_table(tmp_path / name, columns=["a"], rows=[["1"]])
        _keep(tmp_path, name, {"anchor": "same", "tables": ["table.json"]})
    assert [a.anchor for a in load_artifacts(tmp_path)] == ["2026-01-01-a", "same"]


def test_a_table_with_a_ragged_row_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\['x'\]"):
        write_table(tmp_path, columns=["a", "b"], rows=[["x"]])
    (tmp_path / "table.json").write_text(json.dumps({"columns": ["a", "b"], "rows": [["x"]]}))
    with pytest.raises(ValueError, match=r"table\.json"):
        load_table(tmp_path / "table.json")


def _fake_run(answers: dict[str, str]):
    def fake_run(command):
        if command[-1] == "--json":
            return json.dumps({"cpu": {"model": "Xeon", "arch": "x86_64", "logical_cores": 2},
                               "memory": {"total_bytes": 2 * 2**30}, "versions": {"torch": "2.x",
                                                                                  "python": "3.11"}})
        key = " ".join(command[:2]) if command[0] == "git" else Path(command[-1]).name
        return answers.get(key, "")
    return fake_run


@pytest.mark.parametrize("dirty", [False, True])
def test_record_keeps_a_complete_artifact(tmp_path, monkeypatch, dirty):
    monkeypatch.setattr(record_module, "_run", _fake_run({
        "uptime": "load average: 0.10\n", "env": "dspark env table\n", "git rev-parse": "abc123\n",
        "git status": " M src/dspark/x.py\n" if dirty else ""}))
    script = ("import sys; from dspark.bench.artifacts.table import write_table; "
              "write_table(sys.argv[sys.argv.index('--out') + 1], columns=['a s'], rows=[[0.5]])")
    out = record_module.record(results_dir=tmp_path, name="2026-01-01-box-x", title="X",
                               command=[sys.executable, "-c", script], anchor="x")
    meta = json.loads((out / "artifact.json").read_text())
    assert meta["commit"] == "abc123" and meta["anchor"] == "x" and meta["tables"] == ["table.json"]
    assert_line_names(meta["machine"], "Xeon", "2 logical cores", "2.0 GiB", "no GPU")
    assert meta["command"].endswith(f"--out {out}")
    assert ("not_reproducible" in meta) == dirty
    assert (out / "machine.txt").read_text() == "dspark env table\n"
    assert (out / "output.txt").read_text().rstrip().endswith("load average: 0.10")
    (artifact,) = load_artifacts(tmp_path)    # chained, its head pinned: it verifies
    assert artifact.tables[0].rows == (("0.50",),) and artifact.head == read_heads(tmp_path)[out.name]
    assert any("not reproducible" in note for note in artifact.provenance) == dirty
    with pytest.raises(ValueError, match=r"2026-01-01-box-x"):
        record_module.record(results_dir=tmp_path, name="2026-01-01-box-x", title="X",
                             command=[sys.executable, "-c", script])


def test_every_kept_measurement_is_in_an_artifact_directory():
    """A JSON file loose in benchmarks/results/ renders nowhere: keep it in a directory with an
    artifact.json (``python -m dspark.bench.record``, or ``--out DIR`` and an artifact.json by hand)."""
    results = ROOT / "benchmarks" / "results"
    assert sorted(p.name for p in results.glob("*.json")) == []
    assert [d.name for d in results.iterdir() if d.is_dir() and not (d / "artifact.json").is_file()] == []


def test_record_keeps_a_bench_run_from_its_own_ledger(tmp_path, monkeypatch):
    """``--ledger``: the run gets ``--db DIR/ledger.sqlite``; its rows, hashes included, are kept as
    ``ledger.jsonl`` and its head pinned."""
    monkeypatch.setattr(record_module, "_run", _fake_run({"uptime": "load average: 0.10\n",
                                                          "git rev-parse": "abc123\n"}))
    script = ("import sys; from dspark.bench.ledger.ledger import Ledger; from tests.bench.factory "
              "import append_run; append_run(Ledger(sys.argv[sys.argv.index('--db') + 1]))")
    out = record_module.record(results_dir=tmp_path, name="2026-01-01-box-seed", title="S",
                               command=[sys.executable, "-c", script], ledger=True)
    meta = json.loads((out / "artifact.json").read_text())
    assert meta["ledger"] == "ledger.jsonl" and "tables" not in meta and "results" not in meta
    assert f"--db {out / 'ledger.sqlite'} && " in meta["command"]
    assert meta["command"].endswith(f"--rows {out / 'ledger.jsonl'}")
    assert not (out / "ledger.sqlite").exists() and len((out / "ledger.jsonl").read_text().splitlines()) == 7
    (artifact,) = load_artifacts(tmp_path)
    assert artifact.verified == "6 ledger rows" and len(artifact.rows) == 2


def test_figures_outside_a_checkout_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--check", "--root", str(tmp_path)])
    assert exit_info.value.code == 2
    assert_names(" ".join(capsys.readouterr().err.split()), repr(str(tmp_path)), "--root")
