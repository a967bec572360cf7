"""``dspark bench``: run a suite, and read the ledger (list, compare, rerun, report, export).

Thin by design: it parses, calls :mod:`dspark.bench`, and prints. Everything it reads comes from
the installed package and the ledger file, never from the current directory, so it works from
anywhere.

Example::

    dspark bench --suite seed --report bench-report
    dspark bench compare previous latest
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from dspark.cli.bench_common import (
    EXIT_FAILED,
    check_outputs,
    console,
    db_path,
    describe,
    write_json,
)
from dspark.cli.bench_ledger_cmd import (
    compare_runs,
    export_results,
    list_results,
    report_run,
    verify_ledger,
)

__all__ = ["add_parser", "run"]



def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give a comma-separated list")
    return names


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of device counts (e.g. 1,2)") from None
    return counts


def _at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {low}")
        return value
    return parse


_non_negative = _at_least(0)


def _add_db(parser: argparse.ArgumentParser, *, default: Any) -> None:
    parser.add_argument("--db", type=Path, default=default, metavar="PATH",
                        help="the ledger (SQLite); default: $DSPARK_LEDGER, else "
                             "$XDG_DATA_HOME/dspark/ledger.sqlite, else "
                             "~/.local/share/dspark/ledger.sqlite")


def _add_outputs(parser: argparse.ArgumentParser, *, default: Any) -> None:
    from dspark.bench.measure.runner import DEFAULT_ROUNDS

    parser.add_argument("--rounds", type=_at_least(1), metavar="N",
                        default=DEFAULT_ROUNDS if default is None else default,
                        help="launches per configuration, alternating with its 1-device baseline "
                             f"(default {DEFAULT_ROUNDS}); the speedup is the median of the "
                             "rounds' ratios")
    parser.add_argument("--json", type=Path, default=default, metavar="PATH",
                        help="also write the results as a JSON list of objects")
    parser.add_argument("--report", type=Path, default=default, metavar="DIR",
                        help="also write an HTML report with plots to DIR")
    parser.add_argument("--no-progress", action="store_true", default=default,
                        help="no progress bar")
    parser.add_argument("--profile", action="store_true", default=default,
                        help="also record each rank's step breakdown (engine.step_stats(): "
                             "forward, backward, exposed communication, optimizer, data, compute) "
                             "of every timed step, print it per rank, add it to the ledger and "
                             "the report, and flag a straggler rank; the peers have none")
    parser.add_argument("--trace", type=Path, default=default, metavar="DIR",
                        help="also write a PyTorch profiler trace per rank (Chrome/Perfetto JSON, "
                             "DSpark's phases and collectives named) of 2 untimed steps of each "
                             "configuration's first round, to DIR/<configuration>/rank<R>.json; "
                             "DSpark's engine only")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``dspark bench`` and its actions.

    Example::

        add_parser(parser.add_subparsers())
    """
    from dspark.bench.measure.suites import SUITES

    parser = subparsers.add_parser(
        "bench", help="run benchmark suites; list, compare, rerun and export results",
        description="Measure data-parallel training on 1..N devices, keep every result in a "
                    "ledger, and flag scaling anomalies. Without an action, runs a suite.")
    parser.add_argument("--suite", choices=SUITES, default="quick",
                        help="quick (CPU presets, 1 and 2 devices; default), seed (the article's "
                             "table), peers (DSpark beside PyTorch's DDP and FSDP2, and "
                             "DeepSpeed's ZeRO stages when installed: make peers), full (real "
                             "sizes on GPUs)")
    parser.add_argument("--workloads", type=_names, metavar="A,B", help="workloads to run")
    parser.add_argument("--devices", type=_counts, metavar="1,2", help="device counts")
    parser.add_argument("--strategies", type=_names, metavar="S,T",
                        help="replicate, zero1, zero2, zero3, the PyTorch peers torch-ddp, "
                             "torch-fsdp2, or the DeepSpeed peers deepspeed-zero1, "
                             "deepspeed-zero2, deepspeed-zero3 (make peers)")
    parser.add_argument("--precision", help="fp32, fp16 or bf16 (default: the workload's)")
    parser.add_argument("--global-batch", type=_at_least(1), metavar="N",
                        help="samples per step across all devices")
    parser.add_argument("--micro-batch", type=_at_least(1), metavar="N",
                        help="run each rank's share of a step in passes of at most N samples, "
                             "gradients accumulated into one step (default: the workload's "
                             "limit, 32 for gpt2-124m; lower it when a pass does not fit a GPU)")
    parser.add_argument("--warmup", type=_non_negative, metavar="N", help="warm-up steps (discarded)")
    parser.add_argument("--steps", type=_at_least(1), metavar="N", help="timed steps per round")
    _add_db(parser, default=None)
    _add_outputs(parser, default=None)
    parser.set_defaults(func=run, action=None)

    # Options repeated on the actions default to SUPPRESS, so that `dspark bench --db X list`
    # and `dspark bench list --db X` both work (a sub-parser default would overwrite X).
    actions = parser.add_subparsers(dest="action", metavar="[ACTION]")
    listing = actions.add_parser("list", help="one row per result in the ledger")
    _add_db(listing, default=argparse.SUPPRESS)
    comparing = actions.add_parser("compare", help="two runs or commits side by side")
    comparing.add_argument("a", metavar="A", help="run id, commit, 'latest' or 'previous'")
    comparing.add_argument("b", metavar="B", help="run id, commit, 'latest' or 'previous'")
    _add_db(comparing, default=argparse.SUPPRESS)
    rerunning = actions.add_parser("rerun", help="re-run configurations measured on other code")
    rerunning.add_argument("--stale", action="store_true", required=True,
                           help="re-run the configurations this host measured whose latest "
                                "result there was recorded against other code (another commit, "
                                "or uncommitted changes on either side), with their 1-device "
                                "baselines")
    _add_db(rerunning, default=argparse.SUPPRESS)
    _add_outputs(rerunning, default=argparse.SUPPRESS)
    reporting = actions.add_parser("report", help="write the HTML report of a run")
    reporting.add_argument("--run", default="latest", metavar="REF",
                           help="run id, commit, 'latest' (default) or 'previous'")
    reporting.add_argument("--report", type=Path, required=True, metavar="DIR",
                           help="directory to write the report into")
    _add_db(reporting, default=argparse.SUPPRESS)
    exporting = actions.add_parser("export", help="every result (or one run's) as JSON or CSV")
    target = exporting.add_mutually_exclusive_group(required=True)
    target.add_argument("--json", type=Path, metavar="PATH", help="write a JSON list of objects")
    target.add_argument("--csv", type=Path, metavar="PATH", help="write a CSV file")
    target.add_argument("--rows", type=Path, metavar="PATH.jsonl",
                        help="write the ledger itself, every row with its hashes, a JSON object a "
                             "line: what an artifact keeps (every `dspark bench` action reads it "
                             "back with --db PATH.jsonl)")
    exporting.add_argument("--run", metavar="REF", help="only this run or commit (default: all)")
    _add_db(exporting, default=argparse.SUPPRESS)
    verifying = actions.add_parser(
        "verify", help="check the ledger's hash chain; name the first row that fails it",
        description="Check every row against the hash chain and its own content, and report any "
                    "seal. --db takes an SQLite ledger or a kept artifact's rows (.jsonl).")
    verifying.add_argument("--head", metavar="HASH",
                           help="a head kept elsewhere (benchmarks/results/HEADS, a CI log): fail "
                                "unless the chain still reaches it (a deleted or re-chained row)")
    verifying.add_argument("--seal", action="store_true",
                           help="chain a ledger that has none (schema 1 or 2) as it is now; the "
                                "seal is recorded and every verify reports it")
    _add_db(verifying, default=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Dispatch ``dspark bench [ACTION]``; returns the exit code (1 when a configuration failed).

    Example::

        run(build_parser().parse_args(["bench", "list"]))
    """
    handlers = {None: _run_suite, "list": list_results, "compare": compare_runs, "rerun": _rerun,
                "report": report_run, "export": export_results, "verify": verify_ledger}
    return handlers[args.action](args)


def _write_after_run(what: str, write: Callable[[], str], out: Console, err: Console,
                     run_id: str) -> bool:
    """Run one of a finished run's writes and print what it wrote. An OS error (a full disk, a
    folder taken away during the run) is one line naming the path and how to write it again from
    the ledger, not a traceback under the table printed above it. Returns whether it was written."""
    try:
        out.print(write(), highlight=False)
    except OSError as exc:
        again = {"--json": f"dspark bench export --run {run_id} --json PATH",
                 "--report": f"dspark bench report --run {run_id} --report DIR"}[what]
        err.print(f"[bold red]error[/]: {what}: {exc}; the results are in the ledger, write them "
                  f"again with `{again}`", highlight=False)
        return False
    return True


def _run_and_show(configs: Sequence[Any], args: argparse.Namespace, *, seed_table: bool) -> int:
    from dspark.bench.measure.runner import RunFailure, new_run_id, run_suite
    from dspark.bench.present.report import (
        render_breakdown_table,
        render_peer_table,
        render_results_table,
        render_seed_table,
        write_html_report,
    )

    out, err = console(), console(stderr=True)
    db = db_path(args)
    check_outputs(args)  # before anything is measured: a bad path must not cost the run
    failures: list[RunFailure] = []
    run_id = new_run_id()
    started = time.perf_counter()
    results = run_suite(configs, db=db, rounds=args.rounds, progress=not args.no_progress,
                        run_id=run_id, console=err, failures=failures, profile=bool(args.profile),
                        trace_root=args.trace)
    wall_s = time.perf_counter() - started
    if results:
        render_results_table(results, out)
        render_peer_table(results, out)
        render_breakdown_table(results, out)
        if seed_table:
            render_seed_table(results, out, messages=False)  # the results table gave them
    if args.trace is not None:
        _print_traces(results, args.trace, out)
    written = True
    if args.json is not None:
        def json_out() -> str:
            write_json(args.json, [r.to_dict() for r in results])
            return f"wrote {len(results)} results to {args.json}"
        written &= _write_after_run("--json", json_out, out, err, run_id)
    if args.report is not None and results:
        written &= _write_after_run(
            "--report", lambda: f"wrote the report to {write_html_report(results, args.report)}",
            out, err, run_id)
    from dspark.bench.ledger.ledger import Ledger

    with Ledger(db) as ledger:
        head = ledger.head()
    out.print(f"run {run_id}: {len(results)} configurations measured in {args.rounds} round(s) "
              f"in {wall_s:.0f} s, recorded in {db} (hash chain head {head})")
    # Each failure's error output was logged when it happened; this is the summary.
    for failure in failures:
        err.print(f"[bold red]FAILED[/] {describe(failure.config)} (exit code {failure.exit_code}): "
                  "the failed round recorded nothing", highlight=False)
    return EXIT_FAILED if failures or not written else 0


def _print_traces(results: Sequence[Any], trace_root: Path, out: Console) -> None:
    from dspark.bench.measure.peers import PEERS
    from dspark.bench.measure.runner import trace_dir_of

    for result in results:
        where = trace_dir_of(result.config, trace_root)
        files = sorted(where.glob("rank*.json"))
        if files:
            out.print(f"traces of {describe(result.config)}: {where}/rank*.json "
                      f"({len(files)} file{'' if len(files) == 1 else 's'})", highlight=False)
        elif result.strategy in PEERS:
            out.print(f"no trace of {describe(result.config)}: a peer (PyTorch's or "
                      "DeepSpeed's) has no DSpark trace option", highlight=False)


def _run_suite(args: argparse.Namespace) -> int:
    from dspark.bench.measure.suites import SuiteOverrides, build_suite

    overrides = SuiteOverrides(
        workloads=args.workloads or (), devices=args.devices or (),
        strategies=args.strategies or (), precision=args.precision,
        global_batch=args.global_batch, max_micro_batch=args.micro_batch,
        warmup_steps=args.warmup, measure_steps=args.steps)
    configs = build_suite(args.suite, overrides)
    return _run_and_show(configs, args, seed_table=args.suite == "seed")


def _rerun(args: argparse.Namespace) -> int:
    import socket

    from dspark.bench.ledger.ledger import Ledger
    from dspark.bench.measure.provenance import source_commit
    from dspark.bench.measure.suites import Machine

    commit, dirty = source_commit()
    if not commit:
        raise ValueError("the installed DSpark is not a git checkout, so there is no current "
                         "commit to call results stale against; install it from a clone "
                         "(pip install -e .)")
    host = socket.gethostname()
    with Ledger(db_path(args), create=False) as ledger:
        stale = ledger.stale(commit, host=host, current_dirty=dirty)
        known = ledger.latest_by_key(host=host)
        others = sorted({r.host for r in ledger.latest_by_key().values()} - {host})
    out = console()
    code = f"{commit[:12]}{' with uncommitted changes' if dirty else ''}"
    if not known:
        # "Nothing is stale" would read as "everything is current" for a ledger of other machines.
        held = f"results of {', '.join(others)} only" if others else "no results"
        out.print(f"nothing to rerun: the ledger holds {held}, none measured on {host}; rerun "
                  "replays this machine's own configurations (run a suite first: dspark bench)",
                  highlight=False)
        return 0
    if not stale:
        out.print(f"nothing is stale: every configuration {host} measured has its latest result "
                  f"at {code}", highlight=False)
        return 0
    machine = Machine.detect(time_matmuls=False)  # the device count is all a rerun needs
    fits = [c for c in stale if c.num_devices <= machine.num_devices]
    for config in stale:
        if config not in fits:
            out.print(f"  skipped {describe(config)}: this machine has {machine.num_devices} "
                      f"{machine.device_kind}(s)", highlight=False)
    # A speedup needs its baseline measured in the same run (see dspark.bench.analyse.analysis).
    baselines = [known[c.baseline_key].config if c.baseline_key in known
                 else dataclasses.replace(c, num_devices=1, batch_placement="shard")
                 for c in fits if c.key != c.baseline_key]
    configs = list(dict.fromkeys([*fits, *(b for b in baselines if b.key not in
                                            {c.key for c in fits})]))
    why = (" (the tree has uncommitted changes, so no recorded result is of this code)"
           if dirty else "")
    out.print(f"re-running {len(fits)} configuration(s) recorded on {host} against other code "
              f"than {code}{why}, with {len(configs) - len(fits)} baseline(s):", highlight=False)
    for config in configs:
        out.print(f"  {describe(config)}", highlight=False)
    if not configs:
        return 0
    return _run_and_show(configs, args, seed_table=False)
