"""What checking a checkpoint against its manifest costs a load: ``engine.load`` of the same ~1 GB
checkpoint with the check and without it, interleaved, median of several.

    python benchmarks/ckpt_verify_cost.py                  # page cache warm: the worst case
    python benchmarks/ckpt_verify_cost.py --cold           # files evicted from the page cache first

One process (world size 1, CPU). The model is a stack of 4096x4096 linear layers trained one step
with AdamW, so that parameters and optimizer state make ``--gb`` of checkpoint. "Without" loads a
twin of the checkpoint that has no manifest (format 2: its files hard links to the same bytes,
so both read the same page cache), which DSpark loads unverified with a warning: the code path
is the same but for the check. ``--cold`` evicts the files from the page cache before every load
(``posix_fadvise(DONTNEED)``), so each load reads from the disk, as a resumed job does.

Prints the hash rate of one core, then one line per mode: median load seconds with and without
the check, and the difference as a share of the load without it.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dspark
from dspark.checkpoint.manifest import MANIFEST_FILE


def _engine(layers: int) -> dspark.Engine:
    model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)))
    return dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4), strategy="replicate")


def _unverified_twin(ckpt: Path, twin: Path) -> None:
    """``ckpt`` as a format-2 checkpoint: the same data files (hard links), no manifest."""
    twin.mkdir()
    for path in ckpt.iterdir():
        if path.name == MANIFEST_FILE:
            continue
        if path.suffix == ".json":
            raw = json.loads(path.read_text())
            raw.pop("save_id", None)
            if path.name == "dspark.json":
                raw["format_version"] = 2
            (twin / path.name).write_text(json.dumps(raw))
        else:
            os.link(path, twin / path.name)


def _evict(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _hash_rate_gb_s() -> float:
    data = os.urandom(256 * 2**20)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size to aim for")
    parser.add_argument("--repeats", type=int, default=5, help="loads of each kind")
    parser.add_argument("--cold", action="store_true", help="evict the files from the page cache before each load")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args()
    logging.getLogger("dspark.checkpoint.info").setLevel(logging.ERROR)   # the twin's warning, each load
    dspark.init(backend="gloo")
    layers = max(1, round(args.gb * 1e9 / (4096 * 4096 * 4 * 3)))   # parameter + two AdamW moments
    engine = _engine(layers)
    engine.backward(engine(torch.randn(8, 4096)).square().mean())
    engine.step()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt, twin = Path(tmp) / "ckpt", Path(tmp) / "twin"
        engine.save(ckpt)
        _unverified_twin(ckpt, twin)
        size = sum(p.stat().st_size for p in ckpt.iterdir())
        engine.load(ckpt)   # warm-up: allocator, first-touch of the destination buffers
        times: dict[str, list[float]] = {"with": [], "without": []}
        for i in range(args.repeats):
            order = [("with", ckpt), ("without", twin)]
            for kind, path in order if i % 2 == 0 else order[::-1]:   # interleaved: noise falls on both
                if args.cold:
                    _evict(path)
                start = time.perf_counter()
                engine.load(path)
                times[kind].append(time.perf_counter() - start)
    with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
    print(f"sha256 on one core: {_hash_rate_gb_s():.2f} GB/s; threads for the check: "
          f"{min(8, len(os.sched_getaffinity(0)))}; checkpoint {size / 1e9:.2f} GB ({layers} layers), "
          f"{'cold' if args.cold else 'warm'} page cache, {args.repeats} loads each")
    print(f"load with check {with_s:.3f} s, without {without_s:.3f} s (medians; all with: "
          f"{[round(t, 3) for t in times['with']]}, without: {[round(t, 3) for t in times['without']]}); "
          f"the check costs {100 * (with_s - without_s) / without_s:+.1f}% of the load")
    engine.close()
    dspark.shutdown()


if __name__ == "__main__":
    main()
