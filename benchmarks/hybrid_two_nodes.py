"""Hybrid sharding in the lab: 4 CPU ranks as two simulated nodes of 2 (two ``dspark run --nnodes 2
--nproc 2`` launches on this machine, as docs/multinode.md starts two boxes), hybrid-zero2 and
hybrid-zero3 beside zero3 and replicate, each with ``dspark.plan``'s prediction beside it.

    .venv/bin/python -m dspark.bench.record --name DATE-MACHINE-hybrid-two-nodes --anchor hybrid-two-nodes \\
        --title "..." -- env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hybrid_two_nodes.py

The hybrid engines form their shard groups from the node layout the launches give
(``LOCAL_WORLD_SIZE=2``: each launch's 2 ranks), not from ``shard_group_size``. Measured per
strategy: the median step of ``--steps`` timed steps after one warm-up (the slowest rank's), the
tensor peak of one more step (:func:`dspark.planner.peak_memory.measure_peak_bytes`) and the model
state (``memory_report()``), the largest over ranks, and what one step's collectives put on the
wire from one rank, per group (``dspark.comm.stats(group=...)``): inside a shard group, across the
groups (the replica group) and over the whole world. The link is measured first in the same two
launches, inside each node's pair and over the world (:func:`dspark.planner.link_probe.measure_link`),
and the plan (one probe on this process's core) is made over that two-level link with shard groups
of 2. Four ranks on two cores oversubscribe them, and every collective runs through gloo over
loopback (the shared-memory transport is for one launch's world): the run shows the mechanism (groups
from the node layout, what each level carries, model state as planned), not a speed-up. ``--out
DIR`` writes ``DIR/table.json`` (docs/figures.md renders it) and ``DIR/hybrid-two-nodes.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORKLOAD = "gpt2-cpu"
STRATEGIES = ("replicate", "zero3", "hybrid-zero2", "hybrid-zero3")
NODES, PER_NODE = 2, 2
GROUPS = ("shard", "replica", "world")


def _workload(global_batch: int | None) -> tuple[torch.nn.Module, Any, Any, int]:
    from dspark.models import get_workload

    wl = get_workload(WORKLOAD)
    batch = global_batch or wl.default_global_batch
    return wl.build_model(seed=0), wl.make_batch(batch, seed=0), wl.loss, batch


def worker(strategy: str, steps: int, global_batch: int | None) -> None:
    """One strategy on every rank of the two launches; rank 0 prints one JSON line."""
    import dspark
    from dspark import comm
    from dspark.bench.measure.barrier_timing import barrier_timed_ms
    from dspark.engine.for_the_lab import measure_peak_bytes

    world = dspark.init()
    model, batch, loss_fn, _ = _workload(global_batch)
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), strategy=strategy)
    inputs, targets = dspark.distribute_batch(batch, shard_dim=0)

    def step() -> None:
        engine.backward(loss_fn(engine(inputs), targets))
        engine.step()

    step()  # warm-up
    comm.reset_stats()
    step()
    wire = {group: sum(s.wire_bytes for s in comm.stats(group).values()) for group in GROUPS}
    times = [barrier_timed_ms(step, world.device) for _ in range(steps)]
    peak = measure_peak_bytes(step, world.device)
    report = engine.memory_report()
    everyone = comm.all_gather_object({"step_ms": statistics.median(times), "peak_bytes": peak,
                                       "state_bytes": int(report["total_bytes"]), "wire": wire,
                                       "shard_group_size": int(report["shard_group_size"])})
    if world.rank == 0:
        print("RESULT " + json.dumps({
            "step_ms": max(e["step_ms"] for e in everyone), "peak_bytes": max(e["peak_bytes"] for e in everyone),
            "state_bytes": max(e["state_bytes"] for e in everyone),
            "shard_group_size": everyone[0]["shard_group_size"],
            "wire_bytes": {g: max(e["wire"][g] for e in everyone) for g in GROUPS}}), flush=True)
    engine.close()
    dspark.shutdown()


def link_worker() -> None:
    """The link inside each node's pair and over the world; rank 0 prints the two-level link."""
    import dspark
    from dspark import comm
    from dspark.engine.for_the_lab import group_layout, measure_link

    world = dspark.init()
    across = measure_link(world)
    layout = group_layout(world.world_size, local_world_size=world.local_world_size)
    inside = measure_link(world, group=comm.partition_groups(layout.shard_groups(), name="shard"))
    if world.rank == 0:
        print("RESULT " + json.dumps({"inside": dataclasses.asdict(inside), "across": dataclasses.asdict(across)}),
              flush=True)
    dspark.shutdown()


def _link(data: dict[str, Any]) -> Any:
    from dspark.planner import Interconnect

    inside, across = Interconnect.from_dict(data["inside"]), Interconnect.from_dict(data["across"])
    return dataclasses.replace(inside, name="measured: node pairs + world", ranks_per_node=PER_NODE,
                               inter_node=across)


def two_launches(*args: str, timeout_s: float = 900.0) -> dict[str, Any]:
    """Run this script's ``args`` as two ``dspark run`` launches of one machine, node 0 and node 1;
    rank 0's RESULT line."""
    from dspark.launch.launcher import free_port

    dspark_cli = str(Path(sys.executable).with_name("dspark"))
    port = free_port()
    procs = [subprocess.Popen([dspark_cli, "run", "--nproc", str(PER_NODE), "--nnodes", str(NODES),
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in range(NODES)]
    outputs = [proc.communicate(timeout=timeout_s)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"{args}: exit codes {[p.returncode for p in procs]}\n"
                           f"{outputs[0][-3000:]}\n{outputs[1][-3000:]}")
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{args}: no result\n{outputs[0][-3000:]}")


COLUMNS = ("strategy", "groups", "state MB per rank predicted", "state MB measured", "peak MB per rank predicted",
           "peak MB measured", "step ms predicted", "step ms measured", "wire MB per step in a shard group",
           "across groups", "over the world")


def run(steps: int, global_batch: int | None) -> dict[str, Any]:
    import dspark

    link_data = two_launches("--link-worker")
    link = _link(link_data)
    model, batch, loss_fn, global_batch = _workload(global_batch)
    torch.set_num_threads(1)
    plan = dspark.plan(model, batch, loss_fn, devices=[NODES * PER_NODE], strategies=list(STRATEGIES),
                       global_batch=global_batch, interconnect=link, shard_group_size=PER_NODE)
    print(plan, flush=True)
    rows = []
    for strategy in STRATEGIES:
        got = two_launches("--worker", strategy, str(steps), "--global-batch", str(global_batch))
        row = plan.row(strategy, NODES * PER_NODE)
        rows.append({"strategy": strategy, "shard_group_size": got["shard_group_size"],
                     "predicted_state_bytes": row.model_state_bytes, "measured_state_bytes": got["state_bytes"],
                     "predicted_peak_bytes": row.peak_bytes, "measured_peak_bytes": got["peak_bytes"],
                     "predicted_step_ms": row.step_ms, "measured_step_ms": got["step_ms"],
                     "wire_bytes": got["wire_bytes"]})
        print(json.dumps(rows[-1]), flush=True)
    return {"workload": WORKLOAD, "ranks": NODES * PER_NODE, "nodes": NODES, "steps": steps, "link": link_data,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}


def table_rows(data: dict[str, Any]) -> list[list[Any]]:
    out = []
    for r in data["rows"]:
        size = r["shard_group_size"]
        groups = (f"{data['ranks'] // size} x {size}" if size < data["ranks"] else f"1 x {size}")
        out.append([r["strategy"], groups, round(r["predicted_state_bytes"] / 1e6, 2),
                    round(r["measured_state_bytes"] / 1e6, 2), round(r["predicted_peak_bytes"] / 1e6, 1),
                    round(r["measured_peak_bytes"] / 1e6, 1), round(r["predicted_step_ms"], 1),
                    round(r["measured_step_ms"], 1),
                    *(round(r["wire_bytes"][g] / 1e6, 2) for g in GROUPS)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("STRATEGY", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--link-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=None, help="default: the workload's")
    parser.add_argument("--out", type=Path, help="write DIR/table.json and DIR/hybrid-two-nodes.json")
    args = parser.parse_args()
    if args.link_worker:
        link_worker()
        return
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.global_batch)
        return
    data = run(args.steps, args.global_batch)
    for row in table_rows(data):
        print(" | ".join(map(str, row)))
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hybrid-two-nodes.json").write_text(json.dumps(data, indent=2) + "\n")
        write_table(args.out, columns=list(COLUMNS), rows=table_rows(data), caption=(
            f"{WORKLOAD}, AdamW, fp32, its global batch over 4 CPU ranks started as two dspark run launches "
            "of 2 (two simulated nodes; hybrid's shard groups are the launches' pairs, from LOCAL_WORLD_SIZE). "
            "Predicted by dspark.plan over the link measured in the same launches; measured: the slowest "
            "rank's median step, the largest rank's tensor peak and model state, one step's wire bytes "
            "from one rank per group. 4 ranks on 2 cores oversubscribe them and every collective is gloo "
            "over loopback: this shows the mechanism and that the planned bytes hold, not a speed-up."))


if __name__ == "__main__":
    main()
