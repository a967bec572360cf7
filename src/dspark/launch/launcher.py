"""Starting a job: the library half of ``dspark run``, a thin layer over ``torch.distributed.run``.

DSpark has no process manager of its own. :func:`launch` starts PyTorch's launcher (torchrun) as a
child process, so that the caller survives a worker crash and gets the launcher's exit code back.
What DSpark adds is the defaults a small job wants, and a clean stop:

* single node (``nnodes=1``): the rendezvous is on loopback (``127.0.0.1``) on a free port, so two
  jobs on one box never collide on torchrun's fixed default port 29500;
* ``OMP_NUM_THREADS=1`` per worker unless the caller set it: one worker is one core on CPU, and
  N workers each spawning N OpenMP threads would oversubscribe the machine;
* a module target (``module=True``) runs ``python -m NAME`` in every worker, which is how the
  benchmark runner starts ``dspark.bench.measure.worker``;
* SIGTERM, SIGINT and SIGHUP reach the workers as SIGTERM, and they get ``grace_period_s`` to save and
  exit (see :func:`dspark.preemption_requested`), then the whole process tree is killed; nothing
  is left running ([Note: stopping a job] in :mod:`dspark.launch.supervisor`). Workers that exit 0 make
  the job succeed; otherwise the signal then reaches the caller too.

Multi-node jobs pass ``master_addr`` / ``master_port`` through to torchrun's static rendezvous, or
``rdzv_endpoint`` for c10d rendezvous (what Slurm users pass from ``srun``).

Example::

    from dspark.launch.launcher import LaunchSpec, launch
    exit_code = launch(LaunchSpec(target="train.py", nproc=2, args=("--strategy", "zero2")))
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

from dspark.launch.devices import check_fits
from dspark.launch.rank_logs import LOG_DIR_ENV, TEE_ENV
from dspark.launch.supervisor import DEFAULT_GRACE_S, run_supervised

__all__ = [
    "DEFAULT_MASTER_PORT",
    "LOOPBACK_ADDR",
    "LaunchSpec",
    "free_port",
    "launch",
    "launcher_argv",
    "launcher_command",
    "launcher_env",
]

_log = logging.getLogger(__name__)

LOOPBACK_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
"""torchrun's own default; multi-node jobs need one port that every node agrees on."""

@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """What to start, on how many processes and nodes."""

    target: str
    """Path of the Python script, or the module name when ``module=True``."""
    nproc: int
    """Worker processes on this node (one device each: a GPU, or one CPU core)."""
    args: tuple[str, ...] = ()
    """Arguments for the script, passed untouched (``--strategy zero2`` included)."""
    module: bool = False
    """Run ``target`` as ``python -m target`` instead of as a script path."""
    nnodes: int = 1
    """Nodes in the job."""
    node_rank: int = 0
    """This node's rank in ``[0, nnodes)`` (static rendezvous)."""
    master_addr: str | None = None
    """Host of node 0. Single node: defaults to loopback. Multi-node: required (unless ``rdzv_endpoint``)."""
    master_port: int | None = None
    """Port on node 0. Single node: a free port. Multi-node: defaults to 29500 (torchrun's)."""
    rdzv_endpoint: str | None = None
    """``host:port`` of a c10d rendezvous; replaces master_addr/port and node_rank when set."""
    rdzv_id: str = "dspark"
    """Job id for the c10d rendezvous (every node of one job passes the same)."""
    max_restarts: int = 0
    """How many times torchrun restarts the whole worker group after a worker fails."""
    grace_period_s: float = DEFAULT_GRACE_S
    """After SIGTERM/SIGINT/SIGHUP, how long the workers get to exit before the tree is killed."""
    agent: bool = True
    """``False`` runs a one-process, single-node job as a plain child process with the environment
    torchrun would give its only worker (``RANK=0``, ``WORLD_SIZE=1``, ``LOCAL_RANK=0``,
    ``LOCAL_WORLD_SIZE=1``, a loopback ``MASTER_ADDR``/``MASTER_PORT``), without torchrun's agent
    process: less start-up, which the benchmark's 1-device launches use. The worker
    joins a real one-rank process group either way."""
    log_dir: str | None = None
    """A folder for one log file per rank, ``rank-<RANK>.log``, holding that rank's stdout and
    stderr (see :mod:`dspark.launch.rank_logs`); the workers see it in ``DSPARK_LOG_DIR``."""
    tee: bool = False
    """With ``log_dir``: show the workers' output on the console as well."""
    oversubscribe: bool = False
    """Allow ``nproc`` above this node's devices (GPUs, or CPU cores without GPUs): workers then
    share them. Off, :func:`launch` refuses such a spec (see :mod:`dspark.launch.devices`)."""

    def __post_init__(self) -> None:
        _check_int("nproc", self.nproc, low=1)
        _check_int("nnodes", self.nnodes, low=1)
        _check_int("node_rank", self.node_rank, low=0)
        _check_int("max_restarts", self.max_restarts, low=0)
        if (isinstance(self.grace_period_s, bool) or not isinstance(self.grace_period_s, (int, float))
                or not self.grace_period_s > 0):
            raise ValueError(f"grace_period_s={self.grace_period_s!r} must be a positive number of seconds")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.master_port is not None:
            _check_int("master_port", self.master_port, low=1)
            if self.master_port > 65535:
                raise ValueError(f"master_port={self.master_port} must be in [1, 65535]")
        if not isinstance(self.args, tuple) or not all(isinstance(a, str) for a in self.args):
            raise TypeError(f"args={self.args!r} must be a tuple of str")
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"target={self.target!r} must name a script path or, with module=True, a module")
        if self.module:
            if not all(part.isidentifier() for part in self.target.split(".")):
                raise ValueError(f"module target={self.target!r} is not a dotted module name "
                                 f"(e.g. 'dspark.bench.measure.worker'); pass module=False for a script path")
        elif not Path(self.target).is_file():
            where = Path(self.target).resolve()
            raise ValueError(f"script {self.target!r} does not exist or is not a file "
                             f"(looked for {str(where)!r} from cwd {os.getcwd()!r})")
        if not self.agent and (self.nproc, self.nnodes, self.max_restarts, self.rdzv_endpoint) != (
                1, 1, 0, None):
            raise ValueError(f"agent=False runs one process on one node without restarts; got "
                             f"nproc={self.nproc}, nnodes={self.nnodes}, "
                             f"max_restarts={self.max_restarts}, rdzv_endpoint={self.rdzv_endpoint!r}")
        if self.tee and self.log_dir is None:
            raise ValueError("tee=True copies the rank log files to the console: give log_dir too")
        if self.log_dir is not None and not self.agent:
            raise ValueError(f"log_dir={self.log_dir!r} needs the launcher (agent=True): its process "
                             "writes the files")
        if self.rdzv_endpoint is not None:
            if self.master_addr is not None or self.master_port is not None:
                raise ValueError(f"rdzv_endpoint={self.rdzv_endpoint!r} replaces master_addr/master_port: "
                                 f"pass one or the other, not both")
            if ":" not in self.rdzv_endpoint:
                raise ValueError(f"rdzv_endpoint={self.rdzv_endpoint!r} must be 'host:port'")
        elif self.nnodes > 1 and not self.master_addr:
            raise ValueError(f"nnodes={self.nnodes} needs master_addr (the host of node 0, reachable from "
                             f"every node) or rdzv_endpoint='host:port'; loopback only works on one node")


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")


def free_port(host: str = LOOPBACK_ADDR) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it).

    Another process may take it before torchrun binds it; on loopback that race is rare enough.

    Example::

        port = free_port()   # e.g. 41237
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def launcher_argv(spec: LaunchSpec) -> list[str]:
    """The arguments for ``python -m torch.distributed.run`` that start ``spec``.

    Single-node specs without a port get a free loopback port, so two calls may differ in the port.

    Example::

        launcher_argv(LaunchSpec(target="dspark.bench.measure.worker", module=True, nproc=2))
        # ['--nnodes', '1', '--nproc-per-node', '2', '--max-restarts', '0', '--node-rank', '0',
        #  '--master-addr', '127.0.0.1', '--master-port', '41237', '-m', 'dspark.bench.measure.worker']
    """
    argv = ["--nnodes", str(spec.nnodes), "--nproc-per-node", str(spec.nproc),
            "--max-restarts", str(spec.max_restarts)]
    if spec.rdzv_endpoint is not None:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint,
                 "--rdzv-id", spec.rdzv_id]
    else:
        if spec.nnodes == 1:
            addr, port = _single_node_master(spec)
        else:
            addr = str(spec.master_addr)
            port = spec.master_port if spec.master_port is not None else DEFAULT_MASTER_PORT
        argv += ["--node-rank", str(spec.node_rank), "--master-addr", addr, "--master-port", str(port)]
    if spec.module:
        argv.append("-m")
    # torchrun hands everything after the target to the script (argparse REMAINDER), flags included.
    argv += [spec.target, *spec.args]
    return argv


def launcher_command(spec: LaunchSpec) -> list[str]:
    """The whole command line :func:`launch` runs: this interpreter, torchrun (through
    :mod:`dspark.launch.torchrun_entry`, which keeps the script's arguments out of torchrun's parser), then
    its argv; with ``agent=False``, this interpreter running the target itself.

    Example::

        " ".join(launcher_command(LaunchSpec(target="train.py", nproc=2)))
    """
    if not spec.agent:
        return [sys.executable, *(("-m",) if spec.module else ()), spec.target, *spec.args]
    argv = launcher_argv(spec)
    own = len(argv) - len(spec.args)  # torchrun's options and the target: see dspark.launch.torchrun_entry
    return [sys.executable, "-m", "dspark.launch.torchrun_entry", str(own), *argv]


def _single_node_master(spec: LaunchSpec) -> tuple[str, int]:
    """A single-node job's rendezvous: loopback and a free port unless the spec names them."""
    addr = spec.master_addr or LOOPBACK_ADDR
    return addr, spec.master_port if spec.master_port is not None else free_port(addr)


def _one_rank_env(spec: LaunchSpec) -> dict[str, str]:
    """What torchrun sets for the only worker of a one-process job (``agent=False``)."""
    addr, port = _single_node_master(spec)
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1", "MASTER_ADDR": addr,
            "MASTER_PORT": str(port)}


def launcher_env(base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The workers' environment: ``base_env`` (default: this process's) with ``OMP_NUM_THREADS=1``
    added when it is unset or empty. Nothing else is changed.

    Example::

        launcher_env({"PATH": "/usr/bin"})   # {'PATH': '/usr/bin', 'OMP_NUM_THREADS': '1'}
    """
    env = dict(os.environ if base_env is None else base_env)
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = "1"
    return env


@overload
def launch(spec: LaunchSpec, *, env: Mapping[str, str] | None = ...,
           capture: Literal[False] = ...) -> int: ...
@overload
def launch(spec: LaunchSpec, *, env: Mapping[str, str] | None = ...,
           capture: Literal[True]) -> subprocess.CompletedProcess[str]: ...
def launch(spec: LaunchSpec, *, env: Mapping[str, str] | None = None,
           capture: bool = False) -> subprocess.CompletedProcess[str] | int:
    """Run ``spec`` under ``torch.distributed.run`` in a child process and wait for it.

    Returns the launcher's exit code (0 when every worker succeeded, also when they exited 0 after
    a SIGTERM), or with ``capture=True`` the completed process with its ``stdout`` / ``stderr`` as
    text. A spec with more workers than this node has devices raises ``ValueError`` unless
    ``spec.oversubscribe``. ``env`` is the base environment (default: this process's), passed through
    :func:`launcher_env`. Called from the main thread, it passes SIGTERM / SIGINT / SIGHUP on to the
    workers and never leaves a process of the job behind; when the workers did not exit 0, the
    signal is then raised in this process too (SIGINT: ``KeyboardInterrupt``; SIGTERM and SIGHUP:
    their handler, by default termination).

    Example::

        done = launch(LaunchSpec(target="dspark.bench.measure.worker", module=True, nproc=2,
                                 args=("--config", "cfg.json")), capture=True)
        done.returncode, done.stdout
    """
    warning = check_fits(spec.nproc, oversubscribe=spec.oversubscribe)
    if warning:
        _log.warning("%s", warning)
    command = launcher_command(spec)
    _log.info("launching: %s", " ".join(command))
    workers_env = launcher_env(env)
    if spec.log_dir is not None:
        folder = Path(spec.log_dir).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        workers_env[LOG_DIR_ENV] = str(folder)
        workers_env[TEE_ENV] = "1" if spec.tee else "0"
    if not spec.agent:
        workers_env.update(_one_rank_env(spec))
    done = run_supervised(command, env=workers_env, capture=capture, grace_s=spec.grace_period_s,
                          child_is_worker=not spec.agent)
    if done.stop_signal is not None and done.returncode != 0:
        # The job was stopped, not finished, and is cleaned up: now the signal reaches this process
        # as it would have without a job (Ctrl-C raises KeyboardInterrupt, SIGTERM terminates), so
        # a caller running several jobs stops too.
        signal.raise_signal(done.stop_signal)
    if capture:
        return subprocess.CompletedProcess(command, done.returncode, done.stdout, done.stderr)
    return done.returncode
