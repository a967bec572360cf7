"""The benchmark lab, a wing of its own beside the training core (``pip install 'dspark[lab]'``):

* ``measure/``: the suites, the runner and the worker each rank runs, the engines measured beside
  DSpark's, interleaved rounds, and the probes a worker takes;
* ``ledger/``: what a launch measured and the hash-chained SQLite ledger it is appended to;
* ``analyse/``: the analysis, the anomaly rules, noise, comparisons, the plan a result is held to;
* ``present/``: console tables, the HTML report and its figures;
* ``artifacts/``: kept measurements under ``benchmarks/results/``, verified before they are shown;
* ``result.py`` (the vocabulary every part speaks) and ``faults.py`` (faults the lab injects);
  ``python -m dspark.bench.record`` keeps a measurement and ``python -m dspark.bench.figures`` renders
  docs/figures.md from the kept ones.

The lab uses the training core through the public names of its packages and one declared module,
:mod:`dspark.engine.for_the_lab` (see [Note: the lab's one door]); ``import dspark`` and a training
run never import the lab. Names are imported on first use: every
benchmark worker process imports this package, and it should not pay for SQLite, rich and
matplotlib to measure one configuration.

Example::

    from dspark.bench import build_suite, default_db_path, run_suite
    results = run_suite(build_suite("quick"), db=default_db_path())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark.bench.analyse.analysis import annotate
    from dspark.bench.analyse.compare import Comparison
    from dspark.bench.analyse.noise import NoiseModel
    from dspark.bench.artifacts.table import write_table
    from dspark.bench.ledger.ledger import Ledger, default_db_path
    from dspark.bench.ledger.measurement import Measurement
    from dspark.bench.measure.runner import DEFAULT_ROUNDS, BenchRunError, RunFailure, run_suite
    from dspark.bench.measure.suites import SUITES, Machine, SuiteOverrides, build_suite
    from dspark.bench.present.report import (
        render_comparison,
        render_results_table,
        render_seed_table,
        write_html_report,
    )
    from dspark.bench.result import BenchConfig, BenchResult

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
    "write_table",
]

_MODULE_OF = {
    "annotate": "analyse.analysis",
    "Comparison": "analyse.compare",
    "NoiseModel": "analyse.noise",
    "write_table": "artifacts.table",
    "Ledger": "ledger.ledger", "default_db_path": "ledger.ledger",
    "Measurement": "ledger.measurement",
    "BenchRunError": "measure.runner", "DEFAULT_ROUNDS": "measure.runner",
    "RunFailure": "measure.runner", "run_suite": "measure.runner",
    "SUITES": "measure.suites", "Machine": "measure.suites", "SuiteOverrides": "measure.suites",
    "build_suite": "measure.suites",
    "render_comparison": "present.report", "render_results_table": "present.report",
    "render_seed_table": "present.report", "write_html_report": "present.report",
    "BenchConfig": "result", "BenchResult": "result",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dspark.bench.{module}"), name)
