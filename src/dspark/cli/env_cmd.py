"""``dspark env [--json] [--nnodes N] [--master-addr HOST]``: the machine, as a bug report needs
it, and what to check on a node before a multi-node launch (see :mod:`dspark.host`).

The table is for people; ``--json`` is the same data for pasting into an issue or a ledger. Under
Slurm, ``--nnodes`` and ``--master-addr`` default to the job's node count and first host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dspark.launch.slurm import slurm_job

__all__ = ["add_parser", "network_rows", "render_rows", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``dspark env``."""
    parser = subparsers.add_parser(
        "env", help="hardware, topology, network, backends and versions (paste into bug reports)",
        description="Report versions, CPU cores and memory, NUMA nodes, GPUs, coherent CPU-GPU "
                    "memory, NVLink and InfiniBand links, the network interfaces and the one gloo "
                    "and NCCL would use, and the torch.distributed backends. Absent hardware is "
                    "reported as 'not found', never guessed; what would break a multi-node launch "
                    "is a warning.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--nnodes", type=int, default=None,
                        help="nodes of the launch to check (default: SLURM_JOB_NUM_NODES, else 1)")
    parser.add_argument("--master-addr", default=None, metavar="HOST",
                        help="node 0's host: report which interface routes to it (default under "
                             "a multi-node Slurm job: the first host of its nodelist)")
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
        + (f" (netdev {', '.join(dev['netdevs'])})" if dev.get("netdevs") else "")
        for dev in env["infiniband"] for port in dev["ports"]) or absent["infiniband"]))
    if env["infiniband"]:
        rows.append(("NCCL IB ports", ", ".join(env["nccl_ib"]["ports"]) or "none selected"))
    rows += network_rows(env["network"])
    rows.append(("Backends", ", ".join(env["backends"]) or "none"))
    rows += [("WARNING", text) for text in env["warnings"]]
    return rows


def _interface_line(iface: dict[str, Any]) -> str:
    state = ["loopback"] if iface["is_loopback"] else []
    state.append("up" if iface["is_up"] else "down")
    if iface["mtu"]:
        state.append(f"mtu {iface['mtu']}")
    if iface["speed_mbps"]:
        state.append(f"{iface['speed_mbps']} Mb/s")
    addresses = ", ".join([*iface["ipv4"], *iface["ipv6"]]) or "no address"
    return f"{iface['name']} ({', '.join(state)}): {addresses}"


def _choice_line(choice: dict[str, Any]) -> str:
    where = ", ".join(choice["interfaces"]) or "?"
    loopback = " (LOOPBACK)" if choice["is_loopback"] else ""
    return f"{where} {choice['address'] or '(no address)'}{loopback}: {choice['why']}"


def network_rows(net: dict[str, Any]) -> list[tuple[str, str]]:
    """The network part of the table: hostname, interfaces, the route to the master, the socket
    variables and the interfaces gloo and NCCL would use.

    Example::

        dict(network_rows(collect_environment()["network"]))["gloo would use"]
        # 'eth0 10.0.0.5: GLOO_SOCKET_IFNAME=eth0'
    """
    rows = [("Hostname", f"{net['hostname']} -> {', '.join(net['hostname_addresses']) or 'does not resolve'}"),
            ("Network interfaces", "\n".join(_interface_line(i) for i in net["interfaces"]) or "none found")]
    if net["unattributed_ipv4"]:
        rows.append(("Other IPv4 addresses", ", ".join(net["unattributed_ipv4"])
                     + " (no subnet route names their interface)"))
    master = net["master"]
    if master is None:
        route = "pass --master-addr HOST to check the route to node 0"
    elif list(master["addresses"][:1]) == [master["master_addr"]]:
        route = master["how"]
    else:
        route = f"{master['master_addr']} -> {master['how']}"
    rows.append(("Route to master", route))
    rows += [(name, value if value is not None else "unset") for name, value in net["socket_env"].items()]
    rows += [("gloo would use", _choice_line(net["gloo"])),
             ("NCCL would use", _choice_line(net["nccl"]))]
    return rows


def run(args: argparse.Namespace) -> int:
    """Print the environment report."""
    from dspark.host import collect_environment

    job = slurm_job(os.environ)
    nnodes = args.nnodes if args.nnodes is not None else (job.nnodes if job and job.nnodes else 1)
    if nnodes < 1:
        raise ValueError(f"--nnodes={nnodes} must be >= 1")
    master_addr = args.master_addr
    if master_addr is None and job is not None and job.nodelist and nnodes > 1:
        master_addr = job.nodelist[0]
    env = collect_environment(nnodes=nnodes, master_addr=master_addr)
    if args.json:
        sys.stdout.write(json.dumps(env, indent=2) + "\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dspark env", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for field, value in render_rows(env):
        table.add_row(field, value, style="bold red" if field == "WARNING" else None)
    Console().print(table)
    return 0
