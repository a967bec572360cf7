"""Kill-to-resumed time: how long a 2-rank job takes to train again after a worker is SIGKILLed.

Run from the repository root::

    python benchmarks/restart_time.py --kills 10

It starts ``dspark run --nproc 2 --max-restarts KILLS examples/resume_training.py`` (a checkpoint
every ``--save-every`` steps), and KILLS times: waits until the current attempt has trained a few
steps, SIGKILLs one worker (alternating ranks), and times how long until torchrun's restarted
workers have loaded the last checkpoint (``resumed``) and finished their first step (``trained``).
Then it sends SIGTERM (a preemption: the job saves and exits 0) and prints the median, min and max
of both, in seconds; ``--json`` writes every sample, ``--out DIR`` the table as ``DIR/table.json``
for docs/figures.md (see [Note: table artifacts]).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dspark.bench.artifacts.table import write_table
from dspark.launch.process_tree import children

NPROC = 2
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "resume_training.py"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10, help="workers to kill, one per attempt")
    parser.add_argument("--save-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--step-sleep", type=float, default=0.02, help="extra seconds per step")
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/table.json")
    return parser.parse_args()


class _Output:
    """The job's stdout, line by line, each stamped with when it arrived."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self.lines.put((time.monotonic(), line))

    def wait_for(self, pattern: str, timeout_s: float = 300.0) -> tuple[float, re.Match[str]]:
        end = time.monotonic() + timeout_s
        while True:
            stamp, line = self.lines.get(timeout=max(0.1, end - time.monotonic()))
            match = re.search(pattern, line)
            if match:
                return stamp, match


def main() -> int:
    args = parse_args()
    ckpt = Path(tempfile.mkdtemp(prefix="dspark-restart-"))
    command = [sys.executable, "-m", "dspark.cli.main", "run", "--nproc", str(NPROC),
               "--max-restarts", str(args.kills), str(EXAMPLE), "--ckpt", str(ckpt),
               "--steps", "1000000", "--save-every", str(args.save_every), "--log-every", "1",
               "--step-sleep", str(args.step_sleep)]
    errors = tempfile.TemporaryFile(mode="w+")  # the job's stderr: shown only when it fails
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
    out = _Output(job.stdout)
    samples = []
    try:
        resumed_step = 0
        for kill in range(args.kills):
            out.wait_for(rf"^attempt {kill}: step {resumed_step + args.save_every + 2} ")
            (launcher,) = children(job.pid)
            workers = children(launcher.pid)
            victim = workers[kill % len(workers)]
            killed_at = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)  # no exception, no cleanup: a lost machine
            resumed_at, match = out.wait_for(rf"^attempt {kill + 1}: resumed from step (\d+)")
            resumed_step = int(match.group(1))
            trained_at, _ = out.wait_for(rf"^attempt {kill + 1}: step {resumed_step + 1} ")
            samples.append({"kill": kill, "resumed_s": resumed_at - killed_at,
                            "trained_s": trained_at - killed_at, "resumed_from_step": resumed_step})
            print(f"kill {kill + 1}/{args.kills}: resumed from step {resumed_step} after "
                  f"{resumed_at - killed_at:.2f} s, trained again after {trained_at - killed_at:.2f} s",
                  flush=True)
        job.send_signal(signal.SIGTERM)
        code = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    rows = []
    for key, what in (("resumed_s", "resumed (checkpoint loaded)"), ("trained_s", "first step trained again")):
        values = [s[key] for s in samples]
        median, low, high = (f"{v:.2f}" for v in (statistics.median(values), min(values), max(values)))
        print(f"{key}: median {median} s, min {low} s, max {high} s over {len(values)} kills")
        rows.append([what, median, low, high])
    print(f"dspark run exited {code} after SIGTERM")
    if args.out is not None:
        write_table(args.out, columns=["from the kill to", "median s", "min s", "max s"], rows=rows,
                    caption=f"A {NPROC}-rank job (examples/resume_training.py, a checkpoint every "
                            f"{args.save_every} steps, {args.step_sleep:g} s extra per step), one worker "
                            f"SIGKILLed {len(samples)} times, alternating ranks; seconds from the kill, "
                            f"median, min and max over the kills; dspark run exited {code} after SIGTERM.")
    if args.json is not None:
        args.json.write_text(json.dumps({"samples": samples, "exit_code": code}, indent=2) + "\n")
    shutil.rmtree(ckpt, ignore_errors=True)
    if code != 0:
        errors.seek(0)
        print(f"the job's stderr, its end:\n{errors.read()[-4000:]}", file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
