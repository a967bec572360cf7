"""How much ``dspark run`` adds to PyTorch's own launcher, at start and at exit.

Runs the same 2-rank script under ``torchrun --standalone`` and ``dspark run``, interleaved (A B A B
...: the machine may be shared, and both see the same load), and prints the median of each over
``--repeats`` runs: seconds to the first line a worker prints, and to the launcher's exit; and,
for scale, ``python -c 'import dspark'`` alone (to its exit). ``--out DIR`` writes the medians as
``DIR/table.json`` for docs/figures.md (see [Note: table artifacts])::

    .venv/bin/python benchmarks/startup_time.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dspark.bench.measure.rounds import round_order

SCRIPT = """
import dspark
world = dspark.init()
print(f"rank {world.rank} of {world.world_size} ready", flush=True)
dspark.shutdown()
"""

IMPORT_ONLY = "python -c 'import dspark'"


def one_run(command: list[str]) -> tuple[float, float]:
    """(seconds to the first output line, seconds to exit); a command that prints nothing gives its
    exit twice."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    proc.stdout.readline()
    first = time.perf_counter() - started
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{command} exited {proc.returncode}")
    return first, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ready.py"
        script.write_text(SCRIPT)
        commands = {
            "torchrun --standalone": [str(bin_dir / "torchrun"), "--standalone",
                                      f"--nproc-per-node={args.nproc}", str(script)],
            "dspark run": [str(bin_dir / "dspark"), "run", "--nproc", str(args.nproc), str(script)],
            IMPORT_ONLY: [sys.executable, "-c", "import dspark"],
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for repeat in range(args.repeats):
            for name in round_order(list(commands), repeat):
                times[name].append(one_run(commands[name]))
    print(f"median of {args.repeats} (interleaved), seconds:  first output   exit")
    rows = []
    for name, runs in times.items():
        first = "-" if name == IMPORT_ONLY else f"{statistics.median(t[0] for t in runs):.2f}"
        done = f"{statistics.median(t[1] for t in runs):.2f}"
        rows.append([f"`{name}`", first, done])
        print(f"{name:>30}  {first:>12}  {done:>6}")
    if args.out is not None:
        from dspark.bench.artifacts.table import write_table

        write_table(args.out, columns=["command", "first output s", "exit s"], rows=rows,
                    caption=f"{args.nproc} ranks, a script that calls `dspark.init()` and prints one "
                            f"line; median of {args.repeats} runs, the commands interleaved.")


if __name__ == "__main__":
    main()
