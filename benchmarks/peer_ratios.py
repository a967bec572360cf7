"""DSpark's step against each peer's, from a peers run's results (``dspark bench --suite peers --json
PATH``, or ``dspark bench export --json PATH --run REF``): for every workload, the 2-device step
ratio DSpark / peer (below 1: DSpark is faster) of each pairing (``replicate`` / DDP, ``zero1`` and
``zero2`` / DeepSpeed's same stage, ``zero3`` / FSDP2 and DeepSpeed ZeRO-3), and the range of the
per-round ratios (each round's DSpark launch against the same round's peer launch).

    python benchmarks/peer_ratios.py peers.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

PAIRS = (("replicate", "torch-ddp"), ("zero1", "deepspeed-zero1"), ("zero2", "deepspeed-zero2"),
         ("zero3", "torch-fsdp2"), ("zero3", "deepspeed-zero3"))


def ratios(results: list[dict[str, Any]], devices: int = 2) -> list[tuple[str, str, str, float,
                                                                           float, float]]:
    """``(workload, dspark, peer, ratio, lowest round, highest round)`` for every pairing present."""
    by = {(r["workload"], r["num_devices"], r["strategy"]): r for r in results}
    out = []
    for workload in dict.fromkeys(r["workload"] for r in results):
        for ours, theirs in PAIRS:
            a, b = by.get((workload, devices, ours)), by.get((workload, devices, theirs))
            if a is None or b is None:
                continue
            per_round = [x / y for x, y in zip(a["round_step_ms"], b["round_step_ms"], strict=True)]
            out.append((workload, ours, theirs, a["step_ms"] / b["step_ms"], min(per_round),
                        max(per_round)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a JSON list of results")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    with open(args.results) as f:
        results = json.load(f)
    for workload, ours, theirs, ratio, low, high in ratios(results, args.devices):
        print(f"{workload}: {ours} / {theirs} = {ratio:.2f} (rounds {low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
