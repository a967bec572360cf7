"""DSpark's step against each peer's, from a peers run's results (``dspark bench --suite peers --json
PATH``, or ``dspark bench export --json PATH --run REF``): for every workload, the step ratio
DSpark / peer (below 1: DSpark is faster) of each pairing (``replicate`` / DDP, ``zero1`` and
``zero2`` / DeepSpeed's same stage, ``zero3`` / FSDP2 and DeepSpeed ZeRO-3): the median of the
per-round ratios (each round's DSpark launch against the same round's peer launch) and their range.
The lab prints the same table after a run (``DSpark beside its peers``); this reads a saved one.

    python benchmarks/peer_ratios.py peers.json
"""

from __future__ import annotations

import argparse
import json

from dspark.bench.analyse.peer_ratios import peer_ratios
from dspark.bench.result import BenchResult


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a JSON list of results")
    parser.add_argument("--devices", type=int, default=2, help="only pairings on at least this many")
    args = parser.parse_args()
    with open(args.results) as f:
        results = [BenchResult.from_dict(r) for r in json.load(f)]
    for p in peer_ratios(results, min_devices=args.devices):
        print(f"{p.workload} ({p.num_devices} devices): {p.ours} / {p.theirs} = {p.ratio:.3f} "
              f"(rounds {p.lowest:.3f}-{p.highest:.3f}, {p.verdict}; steps {p.ours_ms:.1f} / {p.theirs_ms:.1f} ms)")


if __name__ == "__main__":
    main()
