"""One AdamW step on one core with each of PyTorch's kernels: the default loop, ``foreach=True``
and ``fused=True`` (the one DSpark's engine picks when the factory leaves the choice open, see
:mod:`dspark.policy.optimizer_kernel`). The kernels are interleaved, several repeats each, and the
median step is printed; ``--out DIR`` writes it as ``DIR/table.json`` for docs/figures.md (see
[Note: table artifacts]).

    OMP_NUM_THREADS=1 python benchmarks/optimizer_kernel.py --params-m 5.3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dspark.bench.measure.rounds import round_order

KERNELS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-m", type=float, default=5.3, help="millions of parameters")
    parser.add_argument("--tensors", type=int, default=50, help="how many tensors hold them")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    size = int(args.params_m * 1e6) // args.tensors
    optimizers = {}
    for name, options in KERNELS.items():
        params = [torch.nn.Parameter(torch.randn(size)) for _ in range(args.tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizers[name] = torch.optim.AdamW(params, lr=1e-3, **options)
        optimizers[name].step()  # creates the state
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    for repeat in range(args.repeats):
        for name in round_order(list(optimizers), repeat):
            opt = optimizers[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    total = size * args.tensors
    print(f"AdamW step over {total / 1e6:.1f}M fp32 parameters in {args.tensors} tensors, one thread "
          f"(median of {args.repeats} repeats of {args.steps} steps):")
    loop = statistics.median(times["for-loop"])
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:9s} {median:7.2f} ms  ({loop / median:.1f}x the loop)")
        rows.append([name, f"{median:.2f}", f"{loop / median:.1f}x"])
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, columns=["AdamW kernel", "step ms", "speed vs the for-loop"], rows=rows,
                    caption=f"One AdamW step over {total / 1e6:.1f}M fp32 parameters in {args.tensors} "
                            f"tensors, one thread: each repeat times {args.steps} steps and takes their "
                            f"mean; median of {args.repeats} repeats, the kernels interleaved repeat by "
                            f"repeat.")


if __name__ == "__main__":
    main()
