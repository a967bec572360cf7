"""Slurm's view of the job, for ``dspark run``'s defaults: how many nodes, which one this is, and
which host is node 0.

Under ``srun``, every node runs one ``dspark run`` and Slurm has already said everything torchrun's
static rendezvous needs: ``SLURM_JOB_NUM_NODES`` (or ``SLURM_NNODES``) nodes, this node's
``SLURM_NODEID``, and the hosts in ``SLURM_JOB_NODELIST``, whose first is node 0 (Slurm numbers
nodes in nodelist order). :func:`launch_defaults` fills what the command line left unset from
those, and says what it took, so that a reader of the job log sees where each value came from.

[Note: precedence] A value given on the command line always wins; Slurm fills only what is
missing; the built-in defaults (one node, node rank 0, loopback) come last. A single-node job
(``nnodes=1``, given or from Slurm) takes nothing else from Slurm: it is node 0 on loopback
whatever ``SLURM_NODEID`` says. With ``rdzv_endpoint`` the c10d rendezvous assigns node ranks and
names the host, so only the node count comes from Slurm. ``nproc`` (workers on this node) defaults
to ``SLURM_GPUS_ON_NODE``, then ``SLURM_NTASKS_PER_NODE``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["LaunchDefaults", "SlurmJob", "expand_nodelist", "launch_defaults", "slurm_job"]


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def _expand_range(item: str, whole: str) -> list[str]:
    low, dash, high = item.partition("-")
    if not low.isdigit() or (dash and not high.isdigit()):
        raise ValueError(f"nodelist {whole!r}: {item!r} is not a number or a range like '01-03'")
    if not dash:
        return [low]
    if int(high) < int(low):
        raise ValueError(f"nodelist {whole!r}: range {item!r} runs backwards")
    width = len(low)  # Slurm keeps the zero padding of the lower bound: 08-10 -> 08, 09, 10
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def _expand_host(pattern: str, whole: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"nodelist {whole!r}: unbalanced brackets in {pattern!r}")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    numbers = [n for item in match.group(1).split(",") for n in _expand_range(item.strip(), whole)]
    # A name can hold several bracket groups (rack[1-2]-gpu[1-4]): expand the rest for each.
    return [host for n in numbers for host in _expand_host(head + n + tail, whole)]


def expand_nodelist(text: str) -> list[str]:
    """The host names of a Slurm nodelist, in order (Slurm's compressed syntax).

    Example::

        expand_nodelist("node[01-03,07],gpu5")   # ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    if text.count("[") != text.count("]"):
        raise ValueError(f"nodelist {text!r}: unbalanced brackets")
    hosts = [host for part in _split_top_level(text.strip()) if part.strip()
             for host in _expand_host(part.strip(), text)]
    if not hosts:
        raise ValueError(f"nodelist {text!r} names no host")
    return hosts


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmJob:
    """What Slurm's variables say about this job and this node; ``None`` where a variable is unset."""

    nnodes: int | None
    nnodes_var: str | None
    """The variable ``nnodes`` came from (``SLURM_JOB_NUM_NODES`` or ``SLURM_NNODES``)."""
    node_rank: int | None
    """``SLURM_NODEID``: this node's index in the job's allocation."""
    nodelist: tuple[str, ...]
    """The job's hosts, expanded; node 0 first."""
    nodelist_var: str | None
    nodelist_text: str | None
    """The nodelist as Slurm wrote it (compressed)."""
    gpus_on_node: int | None
    ntasks_per_node: int | None
    step_num_tasks: int | None
    """``SLURM_STEP_NUM_TASKS``: tasks in the ``srun`` step this process belongs to."""
    step_num_nodes: int | None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    # SLURM_NTASKS_PER_NODE may read "4(x2)" on heterogeneous requests; the count comes first.
    match = re.match(r"^(\d+)", raw)
    if match is None:
        raise ValueError(f"Slurm variable {name}={raw!r} is not an integer")
    return int(match.group(1))


def _first_set(environ: Mapping[str, str], *names: str) -> str | None:
    return next((name for name in names if environ.get(name, "").strip()), None)


def slurm_job(environ: Mapping[str, str]) -> SlurmJob | None:
    """Slurm's variables in ``environ``, or ``None`` outside a Slurm job (no ``SLURM_JOB_ID``
    and no node count).

    Example::

        slurm_job({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
                   "SLURM_JOB_NODELIST": "gpu[1-2]"}).nodelist   # ('gpu1', 'gpu2')
    """
    nnodes_var = _first_set(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    if not environ.get("SLURM_JOB_ID", "").strip() and nnodes_var is None:
        return None
    nodelist_var = _first_set(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    nodelist_text = environ[nodelist_var].strip() if nodelist_var else None
    return SlurmJob(nnodes=_env_int(environ, nnodes_var) if nnodes_var else None, nnodes_var=nnodes_var,
                    node_rank=_env_int(environ, "SLURM_NODEID"),
                    nodelist=tuple(expand_nodelist(nodelist_text)) if nodelist_text else (),
                    nodelist_var=nodelist_var, nodelist_text=nodelist_text,
                    gpus_on_node=_env_int(environ, "SLURM_GPUS_ON_NODE"),
                    ntasks_per_node=_env_int(environ, "SLURM_NTASKS_PER_NODE"),
                    step_num_tasks=_env_int(environ, "SLURM_STEP_NUM_TASKS"),
                    step_num_nodes=_env_int(environ, "SLURM_STEP_NUM_NODES"))


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchDefaults:
    """The launch values after Slurm filled what the command line left unset."""

    nproc: int | None
    """``None``: neither the command line nor Slurm said (the caller must ask for it)."""
    nnodes: int
    node_rank: int
    master_addr: str | None
    from_slurm: tuple[str, ...] = ()
    """What came from Slurm, for the job log: ``('nnodes=2 (SLURM_JOB_NUM_NODES)', ...)``."""


def launch_defaults(*, nproc: int | None, nnodes: int | None, node_rank: int | None,
                    master_addr: str | None, rdzv_endpoint: str | None,
                    environ: Mapping[str, str]) -> LaunchDefaults:
    """Fill unset launch values from Slurm (see the module's note on precedence).

    Raises ``ValueError`` when ``srun`` started several tasks per node (each would start its own
    launcher) or when Slurm's node id does not fit its node count.

    Example::

        launch_defaults(nproc=None, nnodes=None, node_rank=None, master_addr=None, rdzv_endpoint=None,
                        environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
                                 "SLURM_JOB_NODELIST": "gpu[1-2]", "SLURM_GPUS_ON_NODE": "8"})
        # LaunchDefaults(nproc=8, nnodes=2, node_rank=1, master_addr='gpu1', from_slurm=(...))
    """
    job = slurm_job(environ)
    if job is None:
        return LaunchDefaults(nproc=nproc, nnodes=1 if nnodes is None else nnodes,
                              node_rank=0 if node_rank is None else node_rank, master_addr=master_addr)
    if job.step_num_tasks is not None and job.step_num_nodes and job.step_num_tasks > job.step_num_nodes:
        raise ValueError(
            f"srun started SLURM_STEP_NUM_TASKS={job.step_num_tasks} tasks on SLURM_STEP_NUM_NODES="
            f"{job.step_num_nodes} node(s): each task would start its own launcher. Start one "
            f"`dspark run` per node: `srun --ntasks-per-node=1 dspark run ...` (its --nproc workers "
            f"are the per-node processes)")
    taken: list[str] = []
    if nnodes is None and job.nnodes is not None:
        nnodes = job.nnodes
        taken.append(f"nnodes={nnodes} ({job.nnodes_var})")
    nnodes = 1 if nnodes is None else nnodes
    if nproc is None and (job.gpus_on_node or job.ntasks_per_node):
        nproc, var = ((job.gpus_on_node, "SLURM_GPUS_ON_NODE") if job.gpus_on_node
                      else (job.ntasks_per_node, "SLURM_NTASKS_PER_NODE"))
        taken.append(f"nproc={nproc} ({var})")
    if nnodes > 1 and rdzv_endpoint is None:
        if node_rank is None and job.node_rank is not None:
            if job.node_rank >= nnodes:
                raise ValueError(f"SLURM_NODEID={job.node_rank} is not a node of nnodes={nnodes}: "
                                 f"run the step on all of the job's nodes, or pass --node-rank")
            node_rank = job.node_rank
            taken.append(f"node_rank={node_rank} (SLURM_NODEID)")
        if master_addr is None and job.nodelist:
            master_addr = job.nodelist[0]
            taken.append(f"master_addr={master_addr} (first host of {job.nodelist_var}={job.nodelist_text})")
    return LaunchDefaults(nproc=nproc, nnodes=nnodes, node_rank=0 if node_rank is None else node_rank,
                          master_addr=master_addr, from_slurm=tuple(taken))
