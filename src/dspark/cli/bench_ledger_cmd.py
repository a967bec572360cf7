"""``dspark bench list | compare | report | export | verify``: the actions that read a ledger (an
SQLite file, or a kept artifact's rows, see [Note: kept rows] in :mod:`dspark.bench.ledger.rows`).

Example::

    dspark bench verify --db benchmarks/results/NAME/ledger.jsonl --head HASH
"""

from __future__ import annotations

import argparse
import csv
import json
from typing import Any

from rich.table import Table

from dspark.cli.bench_common import (
    EXIT_FAILED,
    check_outputs,
    console,
    db_path,
    describe,
    write_json,
)

__all__ = ["compare_runs", "export_results", "list_results", "report_run", "verify_ledger"]


def list_results(args: argparse.Namespace) -> int:
    from dspark.bench.analyse.analysis import annotate
    from dspark.bench.ledger.ledger import Ledger
    from dspark.bench.present.formatting import format_speedup

    with Ledger(db_path(args), create=False) as ledger:
        chain = ledger.verify()  # rows it finds bad are left out of what is read below
        results = annotate(ledger.results(), history=ledger)
    table = Table(title=f"{len(results)} results in {db_path(args)}", title_justify="left")
    for header in ("run", "time (UTC)", "commit", "host", "configuration", "rounds", "step ms",
                   "speedup", "anomalies"):
        # One anomaly kind per line, never cut: the column the reader looks for.
        table.add_column(header, no_wrap=header in ("run", "time (UTC)", "speedup", "anomalies"))
    for r in results:
        table.add_row(r.run_id, r.timestamp[:19], r.git_commit[:10] + ("+" if r.git_dirty else ""),
                      r.host, describe(r.config), str(r.rounds), f"{r.step_ms:.1f}",
                      format_speedup(r),
                      _flags(r, chain))
    console().print(table)
    if chain.bad:
        console(stderr=True).print(
            f"[bold red]TAMPERED[/]: {len(chain.bad)} row(s) fail the hash chain and are left out, "
            f"first {chain.first_bad}; `dspark bench verify` lists them", highlight=False)
    for fault in chain.faults:  # the file as a whole (a missing trigger): no row fails, none is left out
        console(stderr=True).print(f"[bold red]TAMPERED[/]: {fault}", highlight=False)
    return 0


def _flags(result: Any, chain: Any) -> str:
    """One anomaly kind per line, then an injected fault, then a tampered run: what voids a row."""
    from dspark.bench.faults import describe_injected

    flags = list(dict.fromkeys(str(a.get("kind")) for a in result.anomalies))
    flags += [describe_injected(result)] if result.injected_faults else []
    flags += ["TAMPERED (rows left out)"] if result.run_id in chain.bad_runs else []
    return "\n".join(flags) or "-"


def compare_runs(args: argparse.Namespace) -> int:
    from dspark.bench.analyse.compare import compare
    from dspark.bench.analyse.noise import NoiseModel
    from dspark.bench.ledger.ledger import Ledger
    from dspark.bench.present.report import render_comparison

    with Ledger(db_path(args), create=False) as ledger:
        chain = ledger.verify()
        a, b = ledger.resolve(args.a), ledger.resolve(args.b)
        ledger.require_intact(chain, [r.run_id for r in (*a, *b)])
        noise = NoiseModel.from_history(ledger.results())
    render_comparison(compare(a, b, a_label=args.a, b_label=args.b, noise=noise), console())
    return 0


def report_run(args: argparse.Namespace) -> int:
    from dspark.bench.analyse.analysis import annotate
    from dspark.bench.ledger.ledger import Ledger
    from dspark.bench.present.report import write_html_report

    check_outputs(args)
    with Ledger(db_path(args), create=False) as ledger:
        chain = ledger.verify()
        chosen = ledger.resolve(args.run)
        ledger.require_intact(chain, [r.run_id for r in chosen])
        results = annotate(chosen, history=ledger)
    console().print(f"wrote the report of {len(results)} results to "
                    f"{write_html_report(results, args.report)}")
    return 0


def export_results(args: argparse.Namespace) -> int:
    from dspark.bench.analyse.analysis import annotate
    from dspark.bench.ledger.ledger import Ledger
    from dspark.bench.result import BenchResult

    check_outputs(args)
    if args.rows is not None:
        return _export_rows(args)
    with Ledger(db_path(args), create=False) as ledger:
        chain = ledger.verify()
        chosen = ledger.resolve(args.run) if args.run else ledger.results()
        ledger.require_intact(chain, None if not args.run else [r.run_id for r in chosen])
        results = annotate(chosen, history=ledger)
    rows = [r.to_dict() for r in results]
    if args.json is not None:
        write_json(args.json, rows)
        path = args.json
    else:
        names = list(BenchResult.__dataclass_fields__)
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=names)
            writer.writeheader()
            for row in rows:
                # Lists and dicts as JSON text: one cell each, and readable back.
                writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                                 for k, v in row.items()})
        path = args.csv
    console().print(f"wrote {len(rows)} results to {path}")
    return 0


def _export_rows(args: argparse.Namespace) -> int:
    from dspark.bench.ledger.ledger import Ledger
    from dspark.bench.ledger.rows import ROWS_SUFFIX

    if args.run:
        raise ValueError("--rows writes the whole ledger (a run's rows alone would not verify: "
                         "its chain starts in the rows before it); drop --run")
    if args.rows.suffix != ROWS_SUFFIX:
        raise ValueError(f"--rows {str(args.rows)!r}: name it *{ROWS_SUFFIX} (how --db knows it)")
    with Ledger(db_path(args), create=False) as ledger:
        chain = ledger.verify()
        ledger.require_intact(chain)
        count = ledger.export_rows(args.rows)
    console().print(f"wrote {count} rows to {args.rows} (hash chain head {chain.head})",
                     highlight=False)
    return 0


def verify_ledger(args: argparse.Namespace) -> int:
    from dspark.bench.ledger.chain import check_head
    from dspark.bench.ledger.ledger import Ledger

    head = None if args.head is None else check_head(args.head)  # before a --seal writes anything
    with Ledger(db_path(args), create=False, seal=args.seal) as ledger:
        report = ledger.verify(head=head)
    out, err = console(), console(stderr=True)
    for seal in report.seals:
        out.print(f"[bold yellow]SEALED[/]: {ledger.path}: {seal}", highlight=False)
    if report.ok:
        pinned = (f"; the pinned head is reached, {report.after_pinned} row(s) appended since"
                  if report.pinned is not None else "")
        out.print(f"{ledger.path}: {report.rows} row(s), the hash chain holds; head "
                  f"{report.head}{pinned}", highlight=False)
        return 0
    for fault in report.faults:
        err.print(f"[bold red]TAMPERED[/]: {ledger.path}: {fault}", highlight=False)
    if report.bad:
        err.print(f"[bold red]TAMPERED[/]: {ledger.path}: {len(report.bad)} of {report.rows} row(s) "
                  f"fail the hash chain; first {report.first_bad}", highlight=False)
    for row in report.bad[1:]:
        err.print(f"  {row}", highlight=False)
    return EXIT_FAILED

