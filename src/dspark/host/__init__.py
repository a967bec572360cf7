"""What this host is, probed for ``dspark env``: versions, CPU, memory, NUMA, GPUs, NVLink,
InfiniBand, network interfaces and the interface the ranks would use.

Kept apart from :mod:`dspark.comm`, which holds communication alone: nothing here starts a
process group. The ``/sys`` and ``/proc`` roots are parameters throughout, so tests point them at
fake trees.

Example::

    from dspark.host import collect_environment
    env = collect_environment(nnodes=2, master_addr="node0")
    env["network"]["gloo"], env["warnings"]
"""

from dspark.host.cpu_memory import cpu_info, memory_info, numa_nodes
from dspark.host.environment import collect_environment
from dspark.host.gpus import (
    cuda_devices,
    memory_coherence,
    nvidia_smi_gpus,
    nvlink_links,
    parse_addressing_mode,
    parse_nvlink_status,
    parse_smi_gpus,
    parse_topo_matrix,
)
from dspark.host.infiniband import infiniband_devices, nccl_ib_selection
from dspark.host.interfaces import Interface, Route, interfaces, ipv4_routes
from dspark.host.nccl_lists import NcclList, parse_nccl_list
from dspark.host.network import (
    SOCKET_ENV_VARS,
    MasterRoute,
    SocketChoice,
    gloo_choice,
    nccl_choice,
    network_report,
    route_to_master,
)

__all__ = [
    "SOCKET_ENV_VARS",
    "Interface",
    "MasterRoute",
    "NcclList",
    "Route",
    "SocketChoice",
    "collect_environment",
    "cpu_info",
    "cuda_devices",
    "gloo_choice",
    "infiniband_devices",
    "interfaces",
    "ipv4_routes",
    "memory_coherence",
    "memory_info",
    "nccl_choice",
    "nccl_ib_selection",
    "network_report",
    "numa_nodes",
    "nvidia_smi_gpus",
    "nvlink_links",
    "parse_addressing_mode",
    "parse_nccl_list",
    "parse_nvlink_status",
    "parse_smi_gpus",
    "parse_topo_matrix",
    "route_to_master",
]
