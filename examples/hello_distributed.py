"""Hello, distributed: DSpark's placements on every rank, in one screen.

Run it on two CPU cores (or two GPUs)::

    dspark run --nproc 2 examples/hello_distributed.py

or as one plain process (world size 1: every collective is a no-op)::

    python examples/hello_distributed.py

Each rank prints one line: its shard of a sharded tensor, proof that the gathered tensor is whole,
its slice of a batch, the bytes its collectives moved, and that ``shard_dim=None`` is refused.
"""

from __future__ import annotations

import sys

import torch

import dspark
from dspark import comm


def main() -> int:
    torch.set_num_threads(1)  # one worker = one core
    torch.manual_seed(0)  # every rank builds the same global batch
    world = dspark.init()
    comm.reset_stats()

    whole = torch.arange(14.0).view(7, 2)  # (rows, features), the same on every rank
    sharded = dspark.distribute_tensor(whole, shard_dim=0)
    replicated = dspark.distribute_tensor(whole, shard_dim=dspark.REPLICATE)
    gathered_ok = torch.equal(sharded.full(), whole) and torch.equal(replicated.local, whole)

    images, labels = torch.randn(8, 3), torch.arange(8)  # a global batch of 8 samples
    local_images, local_labels = dspark.distribute_batch((images, labels), shard_dim=0)

    try:
        dspark.distribute_tensor(whole, shard_dim=None)  # dspark: ignore[DSP001] (the demo)
        refused = "shard_dim=None was ACCEPTED (bug)"
    except dspark.PlacementError as exc:
        refused = f"shard_dim=None refused: {type(exc).__name__}"

    moved = {kind: s.bytes for kind, s in sorted(comm.stats().items())}
    # One write per line: two ranks share the terminal, and print() may split text and newline.
    sys.stdout.write(
        f"rank {world.rank}/{world.world_size} [{world.backend}]: "
        f"shard {tuple(sharded.local.shape)} {sharded.placement}, "
        f"replica {tuple(replicated.local.shape)} {replicated.placement}, "
        f"full() == whole: {gathered_ok}, "
        f"batch rows {local_labels.tolist()} of {labels.numel()} ({tuple(local_images.shape)}), "
        f"collective bytes {moved}, {refused}\n"
    )
    sys.stdout.flush()
    dspark.shutdown()
    return 0 if gathered_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
