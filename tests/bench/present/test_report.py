from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import pytest
from matplotlib.image import imread
from rich.console import Console

from dspark.bench.analyse.analysis import annotate
from dspark.bench.analyse.compare import compare
from dspark.bench.ledger.measurement import results_from_measurements
from dspark.bench.present.formatting import breakdown_rows
from dspark.bench.present.plots import report_figures
from dspark.bench.present.report import (
    render_breakdown_table,
    render_comparison,
    render_results_table,
    render_seed_table,
    write_html_report,
)
from tests.bench.factory import make_measurement, make_result, profiled_result, seed_results
from tests.messages import assert_line_names, assert_names


def _console() -> Console:
    return Console(record=True, width=250, color_system=None)


def _seed() -> list:
    return annotate(seed_results("resnet50", 245.0, 280.0, 130.0)
                    + seed_results("gpt2-124m", 520.0, 610.0, 270.0))


def test_results_table_lists_every_result_and_anomaly() -> None:
    console = _console()
    render_results_table(_seed(), console)
    text = console.export_text()
    assert "gpt2-124m" in text and "resnet50" in text
    assert "280 (274-286)" in text  # median (p10-p90)
    assert "1.88x (1.88-1.88)" in text and "94%" in text  # median of the rounds (min-max)
    assert text.count("! negative_scaling") == 2 and text.count("! replicated_batch") == 2
    assert_names(" ".join(text.split()), "RSS peak", "whole process")  # what the columns cover
    assert_line_names(text, "2 devices", "1.14x slower", "280 ms", "245 ms")
    assert_line_names(text, "2 devices", "1.17x slower", "610 ms", "520 ms")


def test_seed_table_reproduces_the_article_and_its_verdicts() -> None:
    console = _console()
    render_seed_table(_seed(), console)
    text = console.export_text()
    assert_line_names(text, "2 devices", "bug", "batch replicated")
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.startswith("│")}
    assert rows["resnet50"] == ["245", "280 (0.88x)", "130", "1.88x (1.88-1.88)"]
    assert rows["gpt2-124m"] == ["520", "610 (0.85x)", "270", "1.93x (1.93-1.93)"]
    assert_line_names(text, "resnet50", "2 devices", "replicated batch", "FLAGGED",
                      "(negative_scaling, replicated_batch, off_plan)")
    assert_line_names(text, "resnet50", "2 devices", "sharded", "healthy", "1.88x (1.88-1.88)", "94%")
    assert_line_names(text, "gpt2-124m", "2 devices", "sharded", "healthy", "1.93x (1.93-1.93)",
                      "96%")


def test_seed_table_marks_a_flagged_fix_and_missing_runs() -> None:
    one, _, _ = seed_results()
    slow_fix = make_result(num_devices=2, step_ms=300.0)
    console = _console()
    render_seed_table(annotate([one, slow_fix]), console)
    text = console.export_text()
    assert_line_names(text, "replicated batch", "not measured")
    assert_line_names(text, "sharded", "FLAGGED", "negative_scaling", "off_plan")


def test_comparison_renders_rows_and_counts() -> None:
    console = _console()
    a = [make_result(step_ms=100.0), make_result(num_devices=2, step_ms=60.0)]
    b = [make_result(step_ms=130.0)]
    render_comparison(compare(a, b, a_label="run-1", b_label="run-2"), console)
    text = console.export_text()
    assert "run-2 vs run-1" in text and "+30.0%" in text and "±15%" in text
    assert_line_names(text, "0 faster", "1 slower", "0 within noise", "1 only in A", "0 only in B")


def test_html_report_is_self_contained(tmp_path: Path) -> None:
    index = write_html_report(_seed(), tmp_path / "report", title="Seed <check>")
    page = index.read_text()
    assert index.name == "index.html"
    assert "<title>Seed &lt;check&gt;</title>" in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(images) == 3
    for name, encoded in zip(("speedup", "step_time", "memory"), images, strict=True):
        png = base64.b64decode(encoded)
        assert png == (index.parent / f"{name}.png").read_bytes()
        pixels = imread(io.BytesIO(png), format="png")
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert_line_names(page, "2 devices", "1.14x slower", "280 ms", "245 ms")
    assert "RSS peak" in page
    assert "1e5fe8e01ae526ecb264d4b703095e4a7abb7127" in page  # provenance
    with pytest.raises(ValueError, match=r"results=\[\] is empty"):
        write_html_report([], tmp_path / "empty")


def test_html_report_without_speedups_skips_that_plot(tmp_path: Path) -> None:
    index = write_html_report([make_result(num_devices=2)], tmp_path)
    assert index.read_text().count("data:image/png;base64,") == 2
    assert not (tmp_path / "speedup.png").exists()


def test_seed_table_puts_shared_settings_in_the_title_and_the_rest_in_rows() -> None:
    small = [make_result(workload="gpt2-cpu", global_batch=32, local_batch=32 // n,
                         num_devices=n, step_ms=ms)
             for n, ms in ((1, 500.0), (2, 260.0))]
    console = _console()
    render_seed_table(annotate(seed_results() + small), console)
    text = console.export_text()
    assert_line_names(text, "Step time (ms)", "replicate", "fp16")  # the shared settings
    assert_line_names(text, "│ resnet50", "global batch 256")  # the rest, in the rows
    assert_line_names(text, "│ gpt2-cpu", "global batch 32")
    assert_line_names(text, "gpt2-cpu", "global batch 32", "2 devices", "replicated batch",
                      "not measured")


def test_breakdown_table_and_html_report(tmp_path: Path) -> None:
    slow = profiled_result([[30.0, 31.0, 30.5], [130.0, 131.0, 130.5]])
    peer = results_from_measurements([make_measurement(strategy="torch-ddp", profiled=True,
                                                       hosts_by_rank=["box", "box"],
                                                       config_hash="peer")])[0]
    results = annotate([slow, peer])
    console = Console(record=True, width=250, color_system=None, file=io.StringIO())
    assert render_breakdown_table(results, console)
    text = console.export_text()
    assert_names(text, "Step breakdown per rank", "median ms", "compute ms")
    assert_names(text, "box1", "130", "PyTorch's peers", "no step breakdown")
    assert not render_breakdown_table(annotate([make_result()]), console)
    assert [f.name for f in report_figures(results)][-1] == "breakdown"
    page = write_html_report(results, tmp_path / "report").read_text()
    assert "<h2>Step breakdown per rank</h2>" in page and (tmp_path / "report/breakdown.png").is_file()
    assert_line_names(page, "PyTorch&#x27;s", "no step breakdown", "gpt2-cpu", "torch-ddp", "2 dev")
    assert "breakdown" not in [f.name for f in report_figures([make_result()])]
    assert breakdown_rows(peer) == [[
        "gpt2-cpu, 2 dev, torch-ddp, bf16, batch shard 8", "-", "box", *["-"] * 7]]
    assert breakdown_rows(make_result()) == []  # not profiled
