"""``dspark run``: start a script (or module) on N processes through ``torch.distributed.run``.

Parsing only; :mod:`dspark.launch.launcher` builds the launcher's command and runs it. Everything after
the script path belongs to the script, untouched, flags included::

    dspark run --nproc 2 train.py --strategy zero2
    dspark run --nproc 2 -m dspark.bench.measure.worker --config cfg.json
    dspark run --nproc 8 --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 train.py
    srun --ntasks-per-node=1 dspark run train.py   # nodes, node rank, node 0, --nproc from Slurm

Under Slurm, options left unset come from Slurm's variables (:mod:`dspark.launch.slurm`), and what was
taken is printed on stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping

from dspark.launch.devices import check_fits
from dspark.launch.launcher import LaunchSpec, launch, launcher_command
from dspark.launch.slurm import launch_defaults
from dspark.launch.supervisor import DEFAULT_GRACE_S

__all__ = ["add_parser", "launch_plan", "run", "spec_from_args"]

_DEFAULT_TIMEOUT_S = 300.0
"""``dspark.init``'s default timeout, stated here without importing PyTorch (a test holds them equal)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``dspark run``."""
    parser = subparsers.add_parser(
        # allow_abbrev=False: a script flag that abbreviates one of ours (`train.py --master 1`)
        # belongs to the script; argparse would otherwise stop on it as ambiguous
        "run", allow_abbrev=False, help="run a script on N processes (wraps torch.distributed.run)",
        description="Start SCRIPT on --nproc processes per node through PyTorch's launcher "
                    "(torch.distributed.run), with OMP_NUM_THREADS=1 per worker unless set and, on "
                    "one node, a rendezvous on 127.0.0.1 at a free port. SIGTERM, SIGINT and SIGHUP "
                    "reach the workers as SIGTERM; after --grace-period the whole process tree is "
                    "killed. Exit code: 0 when every worker exited 0, also after a SIGTERM they "
                    "handled; a failed worker's own (128 + N if signal N killed it), with one line "
                    "naming the rank; otherwise the signal ends dspark run too (130 after Ctrl-C). "
                    "A collective that waits longer than the script's dspark.init(timeout=SECONDS), "
                    f"{_DEFAULT_TIMEOUT_S:g} s by default, raises dspark.CollectiveTimeoutError on "
                    "every rank that waits (docs/launch.md).")
    parser.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=None,
                        help="worker processes on this node (one device each: a GPU or a CPU core); "
                             "required outside Slurm, else SLURM_GPUS_ON_NODE or SLURM_NTASKS_PER_NODE")
    parser.add_argument("--nnodes", type=int, default=None,
                        help="nodes in the job (default: SLURM_JOB_NUM_NODES under Slurm, else 1)")
    parser.add_argument("--node-rank", type=int, default=None,
                        help="this node's rank (default: SLURM_NODEID under Slurm, else 0)")
    parser.add_argument("--master-addr", default=None,
                        help="host of node 0 (default: the first host of SLURM_JOB_NODELIST under "
                             "Slurm; 127.0.0.1 on one node; required for several)")
    parser.add_argument("--master-port", type=int, default=None,
                        help="port on node 0 (default: a free port on one node, 29500 on several)")
    parser.add_argument("--rdzv-endpoint", default=None,
                        help="host:port of a c10d rendezvous (instead of --master-addr/--master-port)")
    parser.add_argument("--rdzv-id", default=None,
                        help="job id for the c10d rendezvous of --rdzv-endpoint (default dspark)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the worker group this many times after a failure (default 0)")
    parser.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                        help="after SIGTERM/SIGINT/SIGHUP (passed on to the workers), how long they "
                             "get to save and exit before the whole job is killed "
                             f"(default {DEFAULT_GRACE_S:g})")
    parser.add_argument("--log-dir", default=None, metavar="DIR",
                        help="write each rank's stdout and stderr to DIR/rank-<RANK>.log (the "
                             "workers see DIR in DSPARK_LOG_DIR)")
    parser.add_argument("--tee", action="store_true",
                        help="with --log-dir, show the workers' output on the console as well")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow --nproc above this node's devices (its GPUs, or its CPU cores "
                             "when it has none): workers then share them")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the launcher command instead of running it")
    # One REMAINDER positional: a separate `script` positional would let argparse eat a "--" that
    # follows the script, and the script's own arguments must arrive untouched.
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="SCRIPT [ARGS ...]",
                        help="the script path (or module with -m) and its arguments")
    parser.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchSpec:
    """The :class:`~dspark.launch.launcher.LaunchSpec` that parsed ``dspark run`` arguments describe, with
    Slurm's values for what they leave unset (``environ``: default this process's).

    Example::

        spec_from_args(parser.parse_args(["run", "--nproc", "2", "train.py", "--lr", "3e-4"]))
        # LaunchSpec(target='train.py', nproc=2, args=('--lr', '3e-4'), ...)
    """
    return launch_plan(args, environ)[0]


def launch_plan(args: argparse.Namespace,
                environ: Mapping[str, str] | None = None) -> tuple[LaunchSpec, tuple[str, ...]]:
    """The launch spec, and what it took from Slurm (``('nnodes=2 (SLURM_JOB_NUM_NODES)', ...)``).

    Example::

        spec, from_slurm = launch_plan(parser.parse_args(["run", "train.py"]), os.environ)
    """
    command = list(args.command)
    if command[:1] == ["--"]:  # `dspark run --nproc 2 -- train.py`: the separator, not the script
        command = command[1:]
    if not command:
        raise ValueError("no script given: usage is `dspark run --nproc N SCRIPT [ARGS ...]` "
                         "(or `-m MODULE [ARGS ...]`)")
    filled = launch_defaults(nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                             master_addr=args.master_addr, rdzv_endpoint=args.rdzv_endpoint,
                             environ=os.environ if environ is None else environ)
    if filled.nproc is None:
        env = os.environ if environ is None else environ
        seen = [f"{v}={env[v]!r}" for v in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE") if v in env]
        raise ValueError("--nproc N is required: how many workers to start on this node (under Slurm "
                         "it defaults to SLURM_GPUS_ON_NODE or SLURM_NTASKS_PER_NODE, "
                         + (f"which give no count here: {', '.join(seen)})" if seen
                            else "neither set here)"))
    if args.rdzv_id is not None and args.rdzv_endpoint is None:
        raise ValueError(f"--rdzv-id {args.rdzv_id} names a c10d rendezvous, which only "
                         "--rdzv-endpoint HOST:PORT starts; give both, or use --master-addr / "
                         "--master-port without an id")
    try:
        spec = LaunchSpec(target=command[0], args=tuple(command[1:]), module=args.module,
                          nproc=filled.nproc, nnodes=filled.nnodes, node_rank=filled.node_rank,
                          master_addr=filled.master_addr, master_port=args.master_port,
                          rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id or "dspark",
                          max_restarts=args.max_restarts, grace_period_s=args.grace_period,
                          oversubscribe=args.oversubscribe, log_dir=args.log_dir, tee=args.tee)
    except (ValueError, TypeError) as exc:  # LaunchSpec names its fields; the user typed flags
        message = str(exc).replace("pass module=False for a script path",
                                   "drop -m to run a script path")
        raise type(exc)(_FIELD.sub(_flag, message)) from None
    return spec, filled.from_slurm


_FLAGS = {"nproc": "--nproc", "nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
          "master_port": "--master-port", "rdzv_endpoint": "--rdzv-endpoint", "max_restarts": "--max-restarts",
          "grace_period_s": "--grace-period", "oversubscribe": "--oversubscribe",
          "log_dir": "--log-dir", "tee": "--tee"}
_FIELD = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b(=?)(True\b)?")


def _flag(match: re.Match[str]) -> str:
    """``nproc=2`` -> ``--nproc 2``, ``oversubscribe=True`` -> ``--oversubscribe``."""
    return _FLAGS[match.group(1)] + (" " if match.group(2) and not match.group(3) else "")


def run(args: argparse.Namespace) -> int:
    """Launch the job and return the launcher's exit code."""
    spec, from_slurm = launch_plan(args)
    if from_slurm:
        sys.stderr.write(f"dspark run: from Slurm: {', '.join(from_slurm)}\n")
    if args.dry_run:
        sys.stdout.write(shlex.join(launcher_command(spec)) + "\n")
        return 0
    try:  # launch() checks it too; here its message speaks in flags
        check_fits(spec.nproc, oversubscribe=spec.oversubscribe)
    except ValueError as exc:
        raise ValueError(_FIELD.sub(_flag, str(exc))) from None
    return launch(spec)
