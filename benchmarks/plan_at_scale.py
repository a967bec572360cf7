"""What ``dspark plan`` predicts at scale, from one H200's measured step (kept artifacts): ResNet-50
and GPT-2 124M at the seed's global batch 256 in fp16 with AdamW, on 2 DGX Spark boxes (200 Gb/s
RoCE) and on 8 to 512 H100/H200-class GPUs (NVLink in a node of 8, InfiniBand NDR across).

    .venv/bin/python benchmarks/plan_at_scale.py > benchmarks/results/plan-at-scale.md

The compute (forward, backward, optimizer ms) and the step's memory beyond model state come from
``benchmarks/results/2026-12-04-h200/final/{resnet50,gpt2-124m}.json`` (one H200, fp16, measured by
``dspark bench``): ResNet-50 at 256 samples, GPT-2 124M at its micro-batch of 32. Everything else is
the planner's arithmetic (docs/plan.md): model state exact, communication over the profiles'
bandwidth and latency, gradients assumed ready evenly through backward (not measured on the GPU).
Nothing here ran on more than one GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark.models import get_workload
from dspark.plan import Plan, PlanRow, Probe, get_interconnect, model_shape, row_cost

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


def plan_at(workload: str, counts: list[int], interconnect: str, budget: int) -> Plan:
    probe, max_micro = _probe(workload)
    shape = model_shape(get_workload(workload).build_model(device="meta"))
    link = get_interconnect(interconnect)
    rows = []
    for n in counts:
        local = 256 // n
        micro = min(local, max_micro)
        for strategy in ("replicate", "zero1", "zero2", "zero3"):
            cost = row_cost(shape=shape, probe=probe, strategy=strategy, num_ranks=n, micro_batch=micro,
                            passes=local // micro, bucket_mb=25.0, link=link)
            fields = {k: getattr(cost, k) for k in cost.__dataclass_fields__}
            peak = sum(v for k, v in fields.items() if k.endswith("_bytes"))
            rows.append(PlanRow(strategy=strategy, devices=n, micro_batch=micro, passes=local // micro,
                                budget_bytes=budget, fits=peak <= budget, **fields))
    return Plan(rows=tuple(rows), global_batch=256, precision="fp16", interconnect=interconnect,
                memory_budget_bytes=budget, probe=probe)


def main() -> None:
    budget = int(H200_BYTES * 0.9)
    for workload in ("resnet50", "gpt2-124m"):
        print(f"## {workload}, global batch 256, fp16, AdamW\n")
        print("### 2 DGX Spark boxes (roce-200g), H200 compute\n\n```")
        print(plan_at(workload, [1, 2], "roce-200g", budget))
        print("```\n\n### 8 to 512 GPUs (nvlink: NVLink inside 8, InfiniBand NDR across)\n\n```")
        print(plan_at(workload, [1, 8, 16, 64, 128, 256], "nvlink", budget))
        print("```\n")


if __name__ == "__main__":
    main()
