"""One rank of a world of 2 started as two separate ``dspark run --nnodes 2`` launches.

Runs real collectives across the two launches: an all-reduce of each rank's ``rank + 1``, then
two ZeRO-2 training steps (reduce-scatter of gradients, all-gather of parameters) on its half of
a fixed global batch, and the same two steps under hybrid-zero2, whose shard groups come from the
node layout (one rank per launch: the gradients cross between the launches in the replica group).
Writes what it saw to ``OUT_DIR/rank<R>.json`` for the test to compare. The model and batches are
built here from seeds, and by the test for its plain-PyTorch reference, with :func:`make_model` and
:func:`global_batch`.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

GLOBAL_BATCH = 8
STEPS = 2
LR = 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randint(0, 3, (GLOBAL_BATCH,), generator=gen)


def optimizer() -> functools.partial[torch.optim.Optimizer]:
    # SGD with momentum is not scale-invariant: a gradient off by the world size cannot pass.
    return functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)


def main(out_dir: Path) -> int:
    import dspark
    from dspark import comm

    torch.set_num_threads(1)
    world = dspark.init(timeout=60)
    summed = torch.full((4,), float(world.rank + 1))
    comm.all_reduce(summed)
    engine = dspark.Engine(make_model(), optimizer=optimizer(), strategy="zero2", bucket_mb=1e-4)
    for step in range(STEPS):
        x, y = dspark.distribute_batch(global_batch(step), shard_dim=0)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    state = {name: tensor.tolist() for name, tensor in engine.full_state_dict().items()}
    engine.close()
    # hybrid-zero2 with its groups from the node layout: one rank per launch, so each rank is its own
    # shard group and the gradients cross between the two launches in the replica group
    engine = dspark.Engine(make_model(), optimizer=optimizer(), strategy="hybrid-zero2", bucket_mb=1e-4)
    comm.reset_stats()
    for step in range(STEPS):
        x, y = dspark.distribute_batch(global_batch(step), shard_dim=0)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    hybrid = {"state": {name: tensor.tolist() for name, tensor in engine.full_state_dict().items()},
              "shard_group_size": engine.memory_report()["shard_group_size"],
              "replica_all_reduce_calls": comm.stats(group="replica")["all_reduce"].calls}
    result = {"rank": world.rank, "world_size": world.world_size, "backend": world.backend, "hybrid": hybrid,
              "node_rank": int(os.environ["GROUP_RANK"]), "master_addr": os.environ["MASTER_ADDR"],
              "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
              "all_reduce": summed.tolist(), "state": state}
    (out_dir / f"rank{world.rank}.json").write_text(json.dumps(result))
    engine.close()
    del engine
    gc.collect()
    dspark.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
