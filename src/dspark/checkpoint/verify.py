"""Checking a checkpoint's files against its manifest: the records a load reads, as it reads them
(:class:`RecordCheck`), and every byte of every file offline (:func:`verify_checkpoint`, behind
``dspark ckpt verify``). See [Note: checkpoint integrity] in :mod:`dspark.checkpoint.manifest`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.checkpoint import digest
from dspark.checkpoint.manifest import (
    MANIFEST_FILE,
    SUMMARY_FIELDS,
    FileEntry,
    Manifest,
    read_manifest,
)
from dspark.checkpoint.plain_files import (
    DSPARK_JSON,
    TRAINING_STATE,
    check_plain_file,
    read_plain_file,
)
from dspark.errors import CheckpointError, CheckpointIntegrityError

__all__ = ["RecordCheck", "VerifyReport", "verify_checkpoint"]

_FOREIGN = ("a file copied or linked from another checkpoint, or one changed since the save; "
            "restore this checkpoint's own file")


class RecordCheck:
    """The records DCP reads from shard files, each hashed in worker threads beside the read (from
    the same file, see :class:`~dspark.checkpoint.digest.Hasher`) and compared with the manifest in
    :meth:`finish`; each file's size and save id at its first read.

    Example::

        check = RecordCheck(manifest)
        check.record("__0_0.distcp", offset, length)   # as DCP reads it
        check.finish()                                 # raises on a mismatch
    """

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._hasher = digest.Hasher(manifest.hash_name, threads=digest.spare_threads())
        self._expected: dict[object, tuple[str, int, int, str]] = {}
        self._fds: dict[str, int] = {}

    @property
    def records_read(self) -> int:
        return len(self._expected)

    def record(self, name: str, offset: int, length: int) -> None:
        """DCP reads the ``length`` bytes at ``offset`` of shard file ``name``: check them."""
        path = self._manifest.directory / name
        entry = self._manifest.entry(name)
        if name not in self._fds:
            self._fds[name] = self._open(path, entry)
        expected = entry.chunks.get((offset, length))
        if expected is None:
            raise CheckpointIntegrityError(
                f"{str(path)!r}: DCP's index points to bytes {offset}-{offset + length}, which is no "
                "record this save wrote there: .metadata and the shard files come from different saves")
        key = len(self._expected)
        self._expected[key] = (name, offset, length, expected)
        self._hasher.add_range(key, self._fds[name], offset, length)

    def _open(self, path: Path, entry: FileEntry) -> int:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            size_bytes = os.fstat(fd).st_size
            if size_bytes != entry.size_bytes:
                raise CheckpointIntegrityError(f"{str(path)!r} has {size_bytes} bytes, the save wrote "
                                               f"{entry.size_bytes}: {_FOREIGN}")
            if entry.id_record is None:
                raise CheckpointIntegrityError(f"{str(path)!r}: {MANIFEST_FILE} gives no save-id record "
                                               "for this shard file; the manifest is damaged")
            offset, length = entry.id_record
            found = digest.chunk_digest(os.pread(fd, length, offset), self._manifest.hash_name)
            if found != entry.chunks.get((offset, length)):
                raise CheckpointIntegrityError(f"{str(path)!r} does not hold the id of save "
                                               f"{self._manifest.save_id}: {_FOREIGN}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def finish(self) -> None:
        """Wait for every record's digest; :class:`CheckpointIntegrityError` naming the first file
        (in file order) whose bytes differ from what the save wrote."""
        try:
            found = self._hasher.results()
        except EOFError as exc:
            raise CheckpointIntegrityError(f"a shard file of {str(self._manifest.directory)!r} was cut "
                                           f"short while it was read: {exc}") from exc
        finally:
            self.close()
        bad = sorted(value[:3] for key, value in self._expected.items() if found[key] != value[3])
        if bad:
            name, offset, length = bad[0]
            raise CheckpointIntegrityError(
                f"{str(self._manifest.directory / name)!r} is damaged or not this checkpoint's: the "
                f"record at bytes {offset}-{offset + length} differs from what the save wrote "
                f"({len(bad)} record(s) differ): {_FOREIGN}")

    def close(self) -> None:
        self._hasher.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(slots=True)
class VerifyReport:
    """What ``dspark ckpt verify`` found."""

    path: str
    problems: list[str] = field(default_factory=list)
    """One line per file that is not what the save wrote (empty: every byte checked out)."""
    save_id: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    """Step, world size, strategy, ... as the manifest gives them (equal to ``dspark.json``'s)."""
    files: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    manifest_digest: str = ""
    """sha256 of ``manifest.json``: one value that identifies every byte of the checkpoint."""

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | os.PathLike[str]) -> VerifyReport:
    """Check every file of the checkpoint at ``path`` against its manifest, every byte, with no
    engine and no process group. Raises :class:`CheckpointNotFoundError` when there is no
    checkpoint; anything else wrong is a line in the report's ``problems``.

    Example::

        report = verify_checkpoint("ckpt/latest")
        report.ok, report.problems     # (True, [])
    """
    from dspark.checkpoint.info import check_is_checkpoint

    directory = Path(path)
    check_is_checkpoint(directory)
    report = VerifyReport(path=str(directory))
    start = time.perf_counter()
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    if manifest is None:
        report.problems.append(f"{str(directory)!r} has no {MANIFEST_FILE}: it cannot be verified (a "
                               "checkpoint written before DSpark kept manifests, format 2, or one whose "
                               "manifest was removed); re-save it to get one")
        return report
    report.save_id, report.summary = manifest.save_id, dict(manifest.summary)
    # sha256 whatever the files' hash: the value users record stays comparable across versions
    report.manifest_digest = manifest.file_sha256
    for name, entry in sorted(manifest.files.items()):
        problem = _check_whole_file(directory / name, entry, manifest.hash_name)
        if problem is not None:
            report.problems.append(problem)
        else:
            report.files += 1
            report.bytes_checked += entry.size_bytes
    extra = sorted(p.name for p in directory.iterdir() if p.name not in manifest.files and p.name != MANIFEST_FILE)
    if extra:
        report.problems.append(f"{str(directory)!r} holds file(s) this save did not write: {extra}")
    if not report.problems:
        report.problems.extend(_cross_check(directory, manifest))
    report.seconds = time.perf_counter() - start
    return report


def _check_whole_file(path: Path, entry: FileEntry, hash_name: str) -> str | None:
    try:
        size_bytes = check_plain_file(path).st_size
        if size_bytes != entry.size_bytes:
            return f"{str(path)!r} has {size_bytes} bytes, the save wrote {entry.size_bytes}: {_FOREIGN}"
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            found = digest.hash_ranges(fd, list(entry.chunks), hash_name)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return f"{str(path)!r} is missing: the checkpoint is partial"
    except (OSError, EOFError, CheckpointError) as exc:
        return f"{str(path)!r} cannot be read ({type(exc).__name__}: {exc})"
    bad = sorted(key for key, d in entry.chunks.items() if found[key] != d)
    if bad:
        offset, length = bad[0]
        return (f"{str(path)!r} is damaged or not this checkpoint's: {len(bad)} of its {len(entry.chunks)} "
                f"chunk(s) differ, the first at bytes {offset}-{offset + length}: {_FOREIGN}")
    if digest.file_digest([d for _, d in sorted(found.items())], hash_name) != entry.digest:
        return f"{str(path)!r}: its digest in {MANIFEST_FILE} does not follow from its chunks (the manifest is damaged)"
    return None


def _cross_check(directory: Path, manifest: Manifest) -> list[str]:
    """The JSON files name this save, and ``dspark.json`` says what the manifest says."""
    problems = []
    read: dict[str, Any] = {}
    for name, bound in (("dspark.json", DSPARK_JSON), ("training_state.json", TRAINING_STATE)):
        try:
            read[name] = json.loads(read_plain_file(directory / name, bound))
            theirs = read[name].get("save_id")
        except (OSError, ValueError, AttributeError, RecursionError) as exc:  # CheckpointError included
            problems.append(f"{str(directory / name)!r} cannot be read ({type(exc).__name__}: {exc})")
            continue
        if theirs != manifest.save_id:
            problems.append(f"{str(directory / name)!r} names save {theirs!r}, the manifest {manifest.save_id!r}")
    info = read.get("dspark.json", {}) if not problems else {}
    differ = [k for k in SUMMARY_FIELDS if info and info.get(k) != manifest.summary.get(k)]
    if differ:
        problems.append(f"{MANIFEST_FILE} and dspark.json differ in {differ}")
    return problems
