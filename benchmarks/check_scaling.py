"""How `dspark check`'s time and memory grow with the size of the file it checks.

    python benchmarks/check_scaling.py                 # 2k, 4k, 8k lines and a 5 MB file
    python benchmarks/check_scaling.py --lines 2000 20000 --mb
    python benchmarks/check_scaling.py --out DIR       # also DIR/table.json for docs/figures.md

Each size is a generated module of ordinary training-script code (imports, guarded arguments,
loops, try/except, functions, calls the rules read, some findings), checked in a fresh process
(``check_paths``, what ``dspark check FILE`` runs) whose peak resident memory is read from the
kernel. Prints the command and the load average, then one line per size: lines, bytes, seconds
(wall clock, and the process's CPU time: on a shared machine the wall clock also counts the time
other jobs held the cores), peak MB, findings; then the wall time per 1000 lines, which stays flat
when the checker is linear.
``--out DIR`` writes the same rows as ``DIR/table.json`` (see [Note: table artifacts] in
``dspark.bench.artifacts.table``); ``python -m dspark.bench.record ... --anchor check-scaling --
python benchmarks/check_scaling.py`` keeps it as the artifact docs/figures.md renders.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_BLOCK = '''\
dim_{i} = None
if cfg_{i} is not None:
    dim_{i} = cfg_{i}.dim
x_{i} = dspark.distribute_tensor(weights[{i}], shard_dim=dim_{i} if dim_{i} is not None else 0)
for step_{i}, batch_{i} in enumerate(loader):
    xb_{i} = dspark.distribute_batch(batch_{i}, shard_dim=0)
    total_{i} = engine(xb_{i}).sum() * step_{i}
try:
    y_{i} = dspark.distribute_batch(inputs_{i}, shard_dim=dspark.REPLICATE)
except ValueError:
    y_{i} = None


def split_{i}(batch, dim=None):
    if dim is None:
        dim = 0
    with torch.no_grad():
        return dspark.distribute_batch(batch, shard_dim=dim)


'''
_HEADER = "import dspark\nimport torch\n\n"


def generate(*, lines: int | None = None, size_bytes: int | None = None) -> str:
    """A module of about ``lines`` lines (or ``size_bytes`` bytes) of generated code."""
    parts, count, length, i = [_HEADER], 0, len(_HEADER), 0
    while (lines is not None and count < lines) or (size_bytes is not None and length < size_bytes):
        block = _BLOCK.format(i=i)
        parts.append(block)
        count += block.count("\n")
        length += len(block)
        i += 1
    return "".join(parts)


def _measure_one(path: str) -> dict[str, float]:
    from dspark.check import check_paths, check_source

    check_source(_HEADER + _BLOCK.format(i=0), "warm-up.py")   # imports done before the clock starts
    start, cpu_start = time.perf_counter(), time.process_time()
    findings, _files = check_paths([path])
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: kB
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mb": peak_mb, "findings": len(findings)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="*", default=[2000, 4000, 8000])
    parser.add_argument("--mb", type=float, nargs="*", default=[5.0], help="file sizes in MB")
    parser.add_argument("--out", type=Path, help="also write the table as DIR/table.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # the child: check this file, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_measure_one(args.one)))
        return
    print("command:", shlex.join([Path(sys.executable).name, *sys.argv]))
    print("load average before (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    sizes = [("lines", n) for n in args.lines] + [("bytes", int(mb * 1e6)) for mb in args.mb]
    rows: list[list[object]] = []
    print(f"{'lines':>8} {'bytes':>10} {'seconds':>8} {'cpu s':>8} {'peak MB':>8} {'findings':>8} {'s/1k lines':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, amount in sizes:
            source = generate(lines=amount) if kind == "lines" else generate(size_bytes=amount)
            path = Path(tmp) / "generated.py"
            path.write_text(source)
            out = subprocess.run([sys.executable, __file__, "--one", str(path)], check=True,
                                 capture_output=True, text=True)
            result = json.loads(out.stdout)
            lines = source.count("\n")
            print(f"{lines:>8} {len(source):>10} {result['seconds']:>8.2f} {result['cpu_seconds']:>8.2f} "
                  f"{result['peak_mb']:>8.0f} "
                  f"{int(result['findings']):>8} {1000 * result['seconds'] / lines:>10.3f}")
            rows.append([f"{lines:,}", _size(len(source)), f"{result['seconds']:.2f}", f"{result['cpu_seconds']:.2f}",
                         f"{result['peak_mb']:.0f} MB", int(result["findings"]),
                         f"{1000 * result['seconds'] / lines:.2f}"])
    print("load average after (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        path = write_table(args.out, columns=["lines", "bytes", "seconds", "CPU seconds", "peak memory", "findings",
                                              "s per 1000 lines"], rows=rows,
                           caption="`dspark check` on generated training-script code, each size in a "
                                   "fresh process (`check_paths`, what `dspark check FILE` runs); peak "
                                   "memory is the process's peak resident set.")
        print(f"wrote {path}")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB" if num_bytes >= 1e6 else f"{num_bytes / 1e3:.0f} KB"


if __name__ == "__main__":
    main()
