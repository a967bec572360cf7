"""nanoGPT's train.py ported to DSpark, written from the real file and two edit scripts.

DSpark keeps none of nanoGPT's code: fetch its train.py (commit 3adf61e1 of
github.com/karpathy/nanoGPT, the file unchanged since dc81cb36), and this script applies one of
the edit scripts beside it (``diff -e`` output: line numbers and DSpark's lines only) and prints
the port. docs/porting.md walks through both:

- ``minimal.ed``: the fewest changes; nanoGPT's own ``get_batch`` (random windows, a seed per rank,
  as under DDP), evaluation and checkpoint on rank 0 (right under ``strategy='replicate'``; the
  engine names the fix under the others);
- ``exact.ed``: every rank's rows of each step from ``dspark.DataLoader``, evaluation of the same
  windows on every rank, ``engine.save``/``engine.load``: the same losses at any world size and
  strategy, a checkpoint that resumes at any world size.

    git clone https://github.com/karpathy/nanoGPT && cd nanoGPT
    python /path/to/dspark/examples/nanogpt_train/port.py minimal train.py > train_dspark.py
    diff train.py train_dspark.py | grep -c '^[<>]'          # the lines the port changes
    python /path/to/dspark/examples/nanogpt_train/port.py minimal --count   # the same, from the script
    dspark run --nproc 2 train_dspark.py --device=cpu --compile=False --dtype=float32 ...
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_PY_BLOB = "de5785051050d64bbda37a4964c2c079f0739b2b"
"""``git hash-object train.py`` of the nanoGPT file the scripts edit."""
_COMMAND = re.compile(r"^(\d+)(?:,(\d+))?([acd])$")


def commands(script: str) -> list[tuple[int, int, str, list[str]]]:
    """An ``ed`` script as ``diff -e`` writes it: ``(first, last, a|c|d, lines)``, bottom of the file first."""
    out: list[tuple[int, int, str, list[str]]] = []
    lines = script.splitlines()
    i = 0
    while i < len(lines):
        match = _COMMAND.match(lines[i])
        if match is None:
            raise ValueError(f"line {i + 1} of the edit script is no diff -e command: {lines[i]!r}")
        first, last, op = int(match[1]), int(match[2] or match[1]), match[3]
        i += 1
        text: list[str] = []
        if op in "ac":
            while lines[i] != ".":
                text.append(lines[i])
                i += 1
            i += 1
        out.append((first, last, op, text))
    return out


def apply(original: list[str], script: str) -> list[str]:
    """``original``'s lines with the edit script applied (its commands run bottom up, as ed runs them)."""
    lines = list(original)
    for first, last, op, text in commands(script):
        if op == "a":
            lines[first:first] = text
        else:
            lines[first - 1:last] = text
    return lines


def changed_lines(script: str) -> int:
    """What ``diff original port | grep -c '^[<>]'`` counts: the lines removed plus the lines added."""
    return sum((0 if op == "a" else last - first + 1) + len(text) for first, last, op, text in commands(script))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("port", choices=("minimal", "exact"))
    parser.add_argument("train_py", nargs="?", help="nanoGPT's train.py (not needed with --count)")
    parser.add_argument("--count", action="store_true", help="print the lines the port changes, and stop")
    args = parser.parse_args(argv)
    script = (HERE / f"{args.port}.ed").read_text()
    if args.count:
        print(changed_lines(script))
        return 0
    if args.train_py is None:
        parser.error("give nanoGPT's train.py")
    try:
        data = Path(args.train_py).read_bytes()
    except OSError as exc:
        print(f"cannot read {args.train_py!r} ({exc.strerror or exc}): give the path of nanoGPT's train.py "
              "(commit 3adf61e1)", file=sys.stderr)
        return 1
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    if blob != TRAIN_PY_BLOB:
        print(f"{args.train_py} is not the train.py these scripts edit (git blob {blob}, not {TRAIN_PY_BLOB}: "
              "nanoGPT at commit 3adf61e1)", file=sys.stderr)
        return 1
    sys.stdout.write("\n".join(apply(data.decode().splitlines(), script)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
