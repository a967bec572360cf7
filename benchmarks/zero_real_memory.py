"""ZeRO's saving in real memory: each rank's peak resident memory under replicate and each ZeRO stage.

Run from the repository root::

    python benchmarks/zero_real_memory.py

For each strategy it starts a fresh ``--nproc``-rank job (``python -m dspark.bench.measure.rss_worker
STRATEGY``: 5 x Linear(4096, 4096), 83.9M parameters, AdamW, two steps) and prints every rank's peak
resident memory (VmHWM, MiB), ``engine.memory_report()``'s total (MB) and the bytes per parameter
its ranks' peaks saved against replicate's (the mean over ranks). ``--out DIR`` writes the table as
``DIR/table.json`` for docs/figures.md (see [Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from dspark.bench.artifacts.table import write_table
from dspark.bench.measure.rss_worker import LAYERS, STEPS, WIDTH, peak_rss_per_rank

MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="replicate,zero1,zero2,zero3",
                        help="comma-separated; the first is what the others' saving is counted against")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per job")
    parser.add_argument("--width", type=int, default=WIDTH, help="each Linear is width x width")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    peaks = {strategy: peak_rss_per_rank(strategy, nproc=args.nproc, width=args.width)
             for strategy in strategies}
    base = strategies[0]
    num_params = peaks[base][0]["num_params"]
    columns = ["strategy", *(f"peak RSS rank {r} MiB" for r in range(args.nproc)),
               "memory_report() total MB (rank 0)", f"saved vs {base} bytes/param"]
    rows = []
    for strategy, ranks in peaks.items():
        saved = statistics.mean(b["peak_bytes"] - r["peak_bytes"] for b, r in zip(peaks[base], ranks,
                                                                                   strict=True))
        rows.append([strategy, *(f"{r['peak_bytes'] / MIB:.0f}" for r in ranks),
                     f"{ranks[0]['total_bytes'] / 1e6:.1f}", f"{saved / num_params:.1f}"])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(row))
    if args.out is not None:
        write_table(args.out, columns=columns, rows=rows,
                    caption=f"{LAYERS} x Linear({args.width}, {args.width}), {num_params / 1e6:.1f}M parameters, "
                            f"AdamW, {STEPS} steps, {args.nproc} ranks, one fresh job per strategy: peak "
                            f"resident memory (VmHWM) per rank, MiB; the saving is the mean over ranks "
                            f"of {base}'s peak minus the strategy's, per parameter.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
