"""What checking a checkpoint against its manifest costs a load: ``engine.load`` of the same ~1 GB
checkpoint with the check and without it, interleaved, median of several.

    python benchmarks/ckpt_verify_cost.py --repeats 5                  # page cache warm: the worst case
    python benchmarks/ckpt_verify_cost.py --repeats 5 --cache cold     # files evicted first
    python benchmarks/ckpt_verify_cost.py --repeats 5 --cache both --sha256 --out DIR

One process (world size 1, CPU). The model is a stack of 4096x4096 linear layers (``--width``)
trained one step with AdamW, so that parameters and optimizer state make ``--gb`` of checkpoint. "Without" loads a
twin of the checkpoint that has no manifest (format 2: its files hard links to the same bytes,
so both read the same page cache), which DSpark loads unverified, with a warning, when told so
(``engine.load(path, verify=False)``): the code path is the same but for the check. ``--sha256``
adds a third twin whose manifest holds sha256 digests of the same files, as checkpoints saved before
BLAKE3 have. ``--cache cold`` evicts the files from the page cache before every load
(``posix_fadvise(DONTNEED)``), so each load reads from the disk, as a resumed job does.

Prints one line per page-cache mode and hash: median load seconds with and without the check, the
difference as a share of the load without it, and the CPU seconds of the loading thread and of the
hash threads (a load's check can run beside it on one spare core when the second is below the
first, whatever else loads the machine), then the conditions: hash rates of one core, load average.
``--out DIR`` also writes the table as ``DIR/table.json`` (see [Note: table artifacts] in
:mod:`dspark.bench.artifacts.table`), the rows as published and the conditions in its caption; keep
it with ``python -m dspark.bench.record ... -- python benchmarks/ckpt_verify_cost.py ... --out DIR``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dspark
from dspark.bench.artifacts.table import write_table
from dspark.bench.measure.rounds import round_order
from dspark.engine.for_the_lab import MANIFEST_FILE
from dspark.engine.for_the_lab import checkpoint_digest as digest

COLUMNS = ["page cache", "manifest hash", "load without check s", "load with check s", "check's cost",
           "reading thread CPU s", "hash threads CPU s", "load average"]


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _engine(layers: int, width: int) -> dspark.Engine:
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
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


def _sha256_twin(ckpt: Path, twin: Path) -> None:
    """``ckpt`` with a manifest of sha256 digests (as saves before BLAKE3 wrote): the same files
    (hard links), each chunk hashed again."""
    twin.mkdir()
    raw = json.loads((ckpt / MANIFEST_FILE).read_text())
    for path in ckpt.iterdir():
        if path.name != MANIFEST_FILE:
            os.link(path, twin / path.name)
    for name, item in raw["files"].items():
        fd = os.open(ckpt / name, os.O_RDONLY)
        try:
            found = digest.hash_ranges(fd, [(o, n) for o, n, _ in item["chunks"]], "sha256")
        finally:
            os.close(fd)
        item["chunks"] = [[o, n, found[(o, n)]] for (o, n) in sorted(found)]
        item["sha256"] = digest.file_digest([found[key] for key in sorted(found)], "sha256")
        del item[raw["hash"]]
    raw["hash"] = "sha256"
    (twin / MANIFEST_FILE).write_text(json.dumps(raw))


def _evict(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _hash_rate_gb_s(hash_name: str) -> float:
    data = os.urandom(256 * 2**20)
    start = time.perf_counter()
    for piece in range(0, len(data), digest.PIECE_BYTES):
        digest.chunk_digest(memoryview(data)[piece:piece + digest.PIECE_BYTES], hash_name)
    return len(data) / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size to aim for")
    parser.add_argument("--repeats", type=int, default=5, help="loads of each kind")
    parser.add_argument("--width", type=int, default=4096, help="each linear layer is width x width")
    parser.add_argument("--cache", choices=["warm", "cold", "both"], default="warm",
                        help="page cache before each load: warm, cold (files evicted), or both in turn")
    parser.add_argument("--cold", action="store_true", help="the same as --cache cold")
    parser.add_argument("--sha256", action="store_true",
                        help="also load a twin whose manifest holds sha256 digests (saves before BLAKE3)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="write DIR/table.json")
    args = parser.parse_args()
    caches = ["cold"] if args.cold else ["warm", "cold"] if args.cache == "both" else [args.cache]
    logging.getLogger("dspark.checkpoint.info").setLevel(logging.ERROR)   # the twin's warning, each load
    load_before = os.getloadavg()
    dspark.init(backend="gloo")
    layers = max(1, round(args.gb * 1e9 / (args.width**2 * 4 * 3)))   # parameter + two AdamW moments
    engine = _engine(layers, args.width)
    engine.backward(engine(torch.randn(8, args.width)).square().mean())
    engine.step()
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt, twin = Path(tmp) / "ckpt", Path(tmp) / "twin"
        engine.save(ckpt)
        _unverified_twin(ckpt, twin)
        kinds = {"without": twin, digest.HASH_NAME: ckpt}
        if args.sha256:
            _sha256_twin(ckpt, Path(tmp) / "sha256")
            kinds["sha256"] = Path(tmp) / "sha256"
        size = sum(p.stat().st_size for p in ckpt.iterdir())
        for kind, path in kinds.items():   # warm-up: allocator, first-touch of the destination buffers
            engine.load(path, verify=kind != "without")
        for cache in caches:
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            # CPU seconds of the load's own thread and of every other thread (the hash workers): where
            # the second is below the first, one spare core is enough for the check to run beside it
            reading_cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
            other_cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
            for i in range(args.repeats):
                for kind in round_order(list(kinds), i):   # interleaved: noise falls on all
                    path = kinds[kind]
                    if cache == "cold":
                        _evict(path)
                    start, thread_start, process_start = time.perf_counter(), time.thread_time(), _process_cpu_s()
                    engine.load(path, verify=kind != "without")
                    times[kind].append(time.perf_counter() - start)
                    reading_cpu[kind].append(time.thread_time() - thread_start)
                    other_cpu[kind].append(_process_cpu_s() - process_start - reading_cpu[kind][-1])
            without_s = statistics.median(times["without"])
            loadavg = os.getloadavg()[0]
            print(f"{cache} page cache, {args.repeats} loads each, load average {loadavg:.2f}; all loads: "
                  f"{ {kind: [round(t, 3) for t in ts] for kind, ts in times.items()} }")
            for kind in kinds:
                if kind == "without":
                    continue
                with_s = statistics.median(times[kind])
                cost = 100 * (with_s - without_s) / without_s
                reading_s, hashing_s = statistics.median(reading_cpu[kind]), statistics.median(other_cpu[kind])
                rows.append([cache, kind, f"{without_s:.3f}", f"{with_s:.3f}", f"{cost:+.1f}%",
                             f"{reading_s:.3f}", f"{hashing_s:.3f}", f"{loadavg:.2f}"])
                print(f"  {kind}: load with check {with_s:.3f} s, without {without_s:.3f} s (medians); "
                      f"the check costs {cost:+.1f}% of the load; CPU of the reading thread {reading_s:.3f} s, "
                      f"of the hash threads {hashing_s:.3f} s")
    engine.close()
    dspark.shutdown()
    load_after = os.getloadavg()
    rates = ", ".join(f"{name} {_hash_rate_gb_s(name):.2f} GB/s" for name in digest.HASH_NAMES)
    conditions = (f"{size / 1e9:.2f} GB checkpoint ({layers} linear layers of {args.width}x{args.width} "
                  "with AdamW state), "
                  f"one process, {os.cpu_count()} cores, {digest.spare_threads()} hash thread(s) beside "
                  f"the load; {args.repeats} loads of each kind interleaved, medians; hash on one core: "
                  f"{rates}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(conditions)
    if args.out:
        print(f"wrote {write_table(args.out, columns=COLUMNS, rows=rows, caption=conditions)}")


if __name__ == "__main__":
    main()
