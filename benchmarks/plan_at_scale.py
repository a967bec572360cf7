"""What ``dspark plan`` predicts at scale, from one H200's measured step (kept artifacts): ResNet-50
and GPT-2 124M at the seed's global batch 256 in fp16 with AdamW, on 2 and 16 DGX Spark boxes (one
GB10 each, 200 Gb/s RoCE; the H200's step read for a GB10 by the datasheet rates of
:data:`dspark.planner.DEVICES`, see [Note: device profiles]), on 8 to 256 H200 GPUs (NVLink in a
node of 8, InfiniBand NDR across) and on 16 boxes of 8 H200s joined by 200 Gb/s RoCE; every strategy, hybrid sharding's
included (shard groups of one node: a box's GPUs, or one GPU per DGX Spark).

    .venv/bin/python benchmarks/plan_at_scale.py            # the plans, printed
    .venv/bin/python -m dspark.bench.record --name DATE-plan-at-scale --anchor plan-at-scale \
        --title "..." -- .venv/bin/python benchmarks/plan_at_scale.py   # kept: --out DIR

``--out DIR`` also writes ``DIR/table.json`` (one row per workload, link, devices and strategy:
peak, step split into compute, exposed communication and optimizer, speedup against one device),
which docs/figures.md publishes as predictions.

The compute (forward, backward, optimizer ms) and the step's memory beyond model state come from
``benchmarks/results/2026-12-04-h200/final/{resnet50,gpt2-124m}.json`` (one H200, fp16, measured by
``dspark bench``): ResNet-50 at 256 samples, GPT-2 124M at its micro-batch of 32. Everything else is
the planner's arithmetic (docs/plan.md): model state exact, communication over the profiles'
bandwidth and latency, gradients assumed ready evenly through backward (not measured on the GPU).
Nothing here ran on more than one GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dspark.engine import STRATEGIES
from dspark.engine.for_the_lab import HYBRID_STRATEGIES, hybrid_group, needed_bytes
from dspark.models import get_workload
from dspark.planner import (
    DEVICES,
    Plan,
    PlanRow,
    Probe,
    get_interconnect,
    model_shape,
    row_cost,
    scale_probe,
)

ARTIFACTS = Path(__file__).parent / "results" / "2026-12-04-h200" / "final"
H200_BYTES = 143771 * 2**20
"""The H200's memory (machine.txt: 143771 MiB); an H100 has 80 GB."""


def _probe(workload: str) -> tuple[Probe, int]:
    result = json.loads((ARTIFACTS / f"{workload}.json").read_text())[0]
    phases = result["phase_ms_by_rank"][0]
    shape = model_shape(get_workload(workload).build_model(device="meta"))
    unit_bytes = [sum(shape.trainable[i][1].itemsize * _numel(shape.trainable[i][0]) for i in u)
                  for u in shape.units]
    probe = Probe.from_one_step(
        device="NVIDIA H200 (kept artifact)", batch=result["local_batch"],
        forward_ms=phases["forward_ms"], backward_ms=phases["backward_ms"],
        optimizer_ms=phases["optimizer_ms"],
        step_bytes=result["peak_bytes_per_rank"] - result["model_state_bytes_per_rank"],
        num_params=len(shape.trainable), unit_bytes=unit_bytes)
    return probe, result["local_batch"]


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def plan_at(workload: str, counts: list[int], interconnect: str, device: str, group: int | None) -> Plan:
    """Every strategy on each count, each rank a ``device`` (a profile of
    :data:`dspark.planner.DEVICES`: the H200's measured step read for it, see [Note: device profiles]);
    hybrid rows in shard groups of ``group`` ranks (None: one node of the interconnect), where that
    makes several groups."""
    probe, max_micro = _probe(workload)
    target = DEVICES[device]
    if target is not DEVICES["h200"]:
        probe = scale_probe(probe, DEVICES["h200"], target)
    budget = int((H200_BYTES if device == "h200" else target.memory_bytes) * 0.9)
    shape = model_shape(get_workload(workload).build_model(device="meta"))
    link = get_interconnect(interconnect)
    rows = []
    for n in counts:
        local = 256 // n
        micro = min(local, max_micro)
        size = hybrid_group(link, n, group, required=False) if group is None else (group if group < n else None)
        for strategy in (*STRATEGIES, *(HYBRID_STRATEGIES if size is not None else ())):
            shard_group = size if strategy in HYBRID_STRATEGIES else None
            cost = row_cost(shape=shape, probe=probe, strategy=strategy, num_ranks=n, micro_batch=micro,
                            passes=local // micro, bucket_mb=25.0, link=link, shard_group_size=shard_group)
            fields = {k: getattr(cost, k) for k in cost.__dataclass_fields__}
            rows.append(PlanRow(strategy=strategy, devices=n, micro_batch=micro, passes=local // micro,
                                budget_bytes=budget, fits=needed_bytes(cost) <= budget,
                                shard_group_size=shard_group, **fields))
    return Plan(rows=tuple(rows), global_batch=256, precision="fp16", interconnect=interconnect,
                memory_budget_bytes=budget, probe=probe)


LINKS = (("roce-200g", "gb10", "2 and 16 DGX Spark boxes (roce-200g), each a GB10: the H200's step read "
                               "for it by datasheet rates; a box is one GPU: hybrid's shard group is one rank",
          [1, 2, 16], 1),
         ("nvlink", "h200", "8 to 256 H200 GPUs (nvlink: NVLink inside 8, InfiniBand NDR across)",
          [1, 8, 16, 64, 128, 256], None),
         ("nvlink+roce-200g", "h200", "16 boxes of 8 H200 GPUs (NVLink inside a box, 200 Gb/s RoCE between boxes)",
          [1, 8, 128], None))
"""``(interconnect, device profile, heading, device counts, shard group)`` of each table."""


def table_rows(workload: str, interconnect: str, device: str, plan: Plan) -> list[list[Any]]:
    """One published row per plan row: what docs/figures.md shows of the prediction."""
    base = {r.strategy: r.step_ms for r in plan.rows if r.devices == 1}
    base.update({name: base[policy.stage] for name, policy in HYBRID_STRATEGIES.items()})  # vs its stage
    return [[workload, DEVICES[device].name, interconnect, r.devices, r.label, f"{r.micro_batch} x {r.passes}",
             round(r.peak_bytes / 1e9, 2), r.compute_ms, r.comm_exposed_ms, r.optimizer_ms,
             r.step_ms, f"{base[r.strategy] / r.step_ms:.2f}x"] for r in plan.rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the predictions as DIR/table.json")
    args = parser.parse_args()
    rows: list[list[Any]] = []
    for workload in ("resnet50", "gpt2-124m"):
        print(f"## {workload}, global batch 256, fp16, AdamW\n")
        for interconnect, device, heading, counts, group in LINKS:
            plan = plan_at(workload, counts, interconnect, device, group)
            print(f"### {heading}\n\n```\n{plan}\n```\n")
            rows += table_rows(workload, interconnect, device, plan)
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, rows=rows, columns=[
            "workload", "device", "link", "devices", "strategy", "micro-batch x passes", "peak GB per rank",
            "compute ms", "exposed comm ms", "optimizer ms", "step ms", "speedup vs 1 device"],
            caption="Predicted by dspark.plan, not measured: one H200's measured step (the "
                    "2026-12-04-h200 artifact), read for the GB10 of a DGX Spark by the datasheet "
                    "rates of dspark.planner.DEVICES where the device column says so, and the "
                    "planner's arithmetic (docs/plan.md); global batch 256, fp16, AdamW; nothing ran "
                    "on more than one GPU, nor on a GB10.")


if __name__ == "__main__":
    main()
