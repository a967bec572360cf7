"""The benchmark lab: suites, the runner, the ledger, the analysis and the reports.

Names are imported on first use: every benchmark worker process imports this package, and it
should not pay for SQLite, rich and matplotlib to measure one configuration. (``compare`` is not
re-exported: the submodule of that name would shadow it; use ``dspark.bench.compare.compare``.)

Example::

    from dspark.bench import build_suite, default_db_path, run_suite
    results = run_suite(build_suite("quick"), db=default_db_path())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark.bench.analysis import annotate
    from dspark.bench.compare import Comparison
    from dspark.bench.ledger import Ledger, default_db_path
    from dspark.bench.measurement import Measurement
    from dspark.bench.noise import NoiseModel
    from dspark.bench.report import (
        render_comparison,
        render_results_table,
        render_seed_table,
        write_html_report,
    )
    from dspark.bench.result import BenchConfig, BenchResult
    from dspark.bench.runner import DEFAULT_ROUNDS, BenchRunError, RunFailure, run_suite
    from dspark.bench.suites import SUITES, Machine, SuiteOverrides, build_suite

__all__ = [
    "DEFAULT_ROUNDS",
    "SUITES",
    "BenchConfig",
    "BenchResult",
    "BenchRunError",
    "Comparison",
    "Ledger",
    "Machine",
    "Measurement",
    "NoiseModel",
    "RunFailure",
    "SuiteOverrides",
    "annotate",
    "build_suite",
    "default_db_path",
    "render_comparison",
    "render_results_table",
    "render_seed_table",
    "run_suite",
    "write_html_report",
]

_MODULE_OF = {
    "annotate": "analysis",
    "Comparison": "compare",
    "Ledger": "ledger", "default_db_path": "ledger",
    "Measurement": "measurement", "NoiseModel": "noise",
    "render_comparison": "report", "render_results_table": "report",
    "render_seed_table": "report", "write_html_report": "report",
    "BenchConfig": "result", "BenchResult": "result",
    "BenchRunError": "runner", "DEFAULT_ROUNDS": "runner", "RunFailure": "runner",
    "run_suite": "runner",
    "SUITES": "suites", "Machine": "suites", "SuiteOverrides": "suites", "build_suite": "suites",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dspark.bench.{module}"), name)
