"""``dspark env [--json]``: the machine, as a bug report needs it (see :mod:`dspark.comm.topology`).

The table is for people; ``--json`` is the same data for pasting into an issue or a ledger.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parser", "render_rows", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``dspark env``."""
    parser = subparsers.add_parser(
        "env", help="hardware, topology, backends and versions (paste into bug reports)",
        description="Report versions, CPU cores and memory, NUMA nodes, GPUs, coherent CPU-GPU "
                    "memory, NVLink and InfiniBand links, and the torch.distributed backends. "
                    "Absent hardware is reported as 'not found', never guessed.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _gib(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def render_rows(env: dict[str, Any]) -> list[tuple[str, str]]:
    """The ``(field, value)`` rows of the human table, from :func:`collect_environment`'s dict.

    Example::

        render_rows(collect_environment())[0]   # ('DSpark', '0.1.0')
    """
    v, cpu, mem, absent = env["versions"], env["cpu"], env["memory"], env["not_found"]
    rows = [("DSpark", v["dspark"]), ("PyTorch", v["torch"]), ("Python", v["python"])]
    if v["torch_cuda"]:
        rows.append(("CUDA (torch build)", f"{v['torch_cuda']}, NCCL {v['torch_nccl'] or '?'}"))
    rows += [
        ("OS", env["os"]["platform"]),
        ("CPU", f"{cpu['model'] or absent.get('cpu_model', '?')} ({cpu['arch']})"),
        ("CPU cores", f"{cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process"),
        ("Memory", f"{_gib(mem['total_bytes'])} total, {_gib(mem['available_bytes'])} available"),
    ]
    numa = env["numa_nodes"]
    rows.append(("NUMA nodes", "; ".join(f"node{n['id']}: cpus {n['cpus']}, {_gib(n['memory_total_bytes'])}"
                                         for n in numa) or absent["numa_nodes"]))
    devices = env["cuda_devices"]
    rows.append(("CUDA devices", "\n".join(
        f"cuda:{d['index']} {d['name']}, {_gib(d['total_memory_bytes'])}, sm {d['compute_capability']}"
        + (", integrated" if d["is_integrated"] else "") for d in devices) or absent["cuda_devices"]))
    smi = env["nvidia_smi_gpus"]
    if smi:
        rows.append(("nvidia-smi GPUs", "\n".join(f"{g['index']}: {g['name']} (driver {g['driver_version']})"
                                                  for g in smi)))
    coherence = env["memory_coherence"]
    if devices or smi:
        said = {True: "yes", False: "no", None: "unknown"}[coherence["coherent"]]
        rows.append(("Coherent CPU-GPU memory", f"{said}: {coherence['kind']}"
                     + (f" ({'; '.join(coherence['evidence'])})" if coherence["evidence"] else "")))
    nvlink = env["nvlink"]
    if "nvlink" in absent:
        rows.append(("NVLink", absent["nvlink"]))
    else:
        rows.append(("NVLink", "\n".join(f"GPU{p['gpus'][0]} <-> GPU{p['gpus'][1]}: NV{p['links']}"
                                         for p in nvlink["pairs"])
                     or "; ".join(f"GPU{g['gpu']}: {g['active_links']} active links" for g in nvlink["per_gpu"])))
    rows.append(("InfiniBand", "\n".join(
        f"{dev['name']} port {port['port']}: {port['state']}, {port['rate']}, {port['link_layer']}"
        for dev in env["infiniband"] for port in dev["ports"]) or absent["infiniband"]))
    rows.append(("Backends", ", ".join(env["backends"]) or "none"))
    return rows


def run(args: argparse.Namespace) -> int:
    """Print the environment report."""
    from dspark.comm.topology import collect_environment

    env = collect_environment()
    if args.json:
        sys.stdout.write(json.dumps(env, indent=2) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dspark env", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for field, value in render_rows(env):
        table.add_row(field, value)
    Console().print(table)
    return 0
