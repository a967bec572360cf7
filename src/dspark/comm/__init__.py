"""DSpark's communication layer: the only package that calls ``torch.distributed``."""

from dspark.comm.collectives import (
    Group,
    Handle,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_gather_parts,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    default_group,
    destroy_group,
    device_mesh,
    new_group,
    reduce_scatter_tensor,
)
from dspark.comm.observer import CommObserver, current_observer, set_observer
from dspark.comm.shm_setup import transport
from dspark.comm.stats import CollectiveStats, reset_stats, stats
from dspark.comm.subgroups import mesh_2d, partition_groups
from dspark.comm.world import (
    BACKENDS,
    World,
    add_shutdown_hook,
    available_backends,
    get_world,
    init,
    is_initialized,
    shutdown,
)

__all__ = [
    "BACKENDS",
    "CollectiveStats",
    "CommObserver",
    "Group",
    "Handle",
    "World",
    "add_shutdown_hook",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_parts",
    "all_reduce",
    "available_backends",
    "barrier",
    "broadcast",
    "broadcast_object",
    "current_observer",
    "default_group",
    "destroy_group",
    "device_mesh",
    "get_world",
    "init",
    "is_initialized",
    "mesh_2d",
    "new_group",
    "partition_groups",
    "reduce_scatter_tensor",
    "reset_stats",
    "set_observer",
    "shutdown",
    "stats",
    "transport",
]
