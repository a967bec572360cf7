"""docs/figures.md and the README's headline table come from kept artifacts, number for number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.bench.figures import (
    HEADLINE_END,
    HEADLINE_START,
    headline_block,
    load_artifacts,
    render_figures,
    replace_headline,
    unsupported_numbers,
)

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


def test_an_artifact_naming_a_missing_file_is_refused(tmp_path):
    run = tmp_path / "2026-01-01-box"
    run.mkdir()
    (run / "artifact.json").write_text(json.dumps({
        "title": "t", "command": "c", "commit": "x", "machine": "m", "results": ["gone.json"]}))
    with pytest.raises(ValueError, match=r"gone\.json"):
        load_artifacts(tmp_path)
