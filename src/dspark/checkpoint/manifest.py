"""``manifest.json``: what one save wrote, file by file, so that a load reads only that.

[Note: checkpoint integrity] Every save has an id (a random 128-bit hex string, which also names
its staging directory). Once DCP has written the shard files, each rank hashes its share of them and
rank 0 writes ``training_state.json`` and ``dspark.json`` (both carry the id), then
``manifest.json``: the id, the step, world size, strategy and the rest of what ``dspark.json``
reports, the hash it used (``"hash": "blake3"``; older manifests say ``"sha256"`` and still verify),
and for every file its size, its digest and the digest of each chunk (see [Note: checkpoint
digests] in :mod:`dspark.checkpoint.digest`). Every shard file also holds the id itself, as a small
tensor ``save/rank<R>`` its rank wrote: two saves never write the same bytes, even of equal weights.

A load checks, before it uses a file, that the file is the one this save wrote:

* ``dspark.json``, ``training_state.json`` and ``.metadata``: the bytes read are hashed and compared
  with the manifest before they are parsed;
* shard files: each file's size and id record when a rank first reads from it; then each record
  DCP reads is hashed by worker threads that read the same bytes beside DCP's read (see
  :class:`~dspark.checkpoint.verify.RecordCheck`); the tensors go into fresh buffers the engine
  takes only after every rank's check passed.

A mismatch is a :class:`CheckpointIntegrityError` naming the file, on every rank, with the engine
unchanged. ``dspark ckpt verify`` checks every byte of every file offline.

What this protects against: a file copied or hard-linked from another checkpoint (of the same model,
with the same names), a JSON file edited by hand or taken from another save, a file damaged on
disk or cut short by a copy. What it does not: someone who rewrites ``manifest.json`` to match
their changes. The manifest is no signature; its own digest, which ``dspark ckpt verify`` prints,
identifies the whole checkpoint where it is recorded elsewhere.

Checkpoints of format 2 (before manifests) load with a warning that their files are unverified;
a format-3 checkpoint without its manifest is refused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.checkpoint import digest
from dspark.checkpoint.plain_files import (
    MANIFEST,
    Bound,
    check_plain_file,
    read_plain_file,
    write_json,
)
from dspark.errors import CheckpointError, CheckpointIntegrityError

__all__ = ["MANIFEST_FILE", "MAX_MANIFEST_FILES", "SUMMARY_FIELDS", "FileEntry", "Manifest", "build_manifest",
           "check_bytes", "file_chunks", "hash_files",
           "id_tensor", "read_manifest", "read_verified", "save_id_key", "write_manifest"]

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_FORMAT = "dspark-manifest"
_VERSION = 1
MAX_MANIFEST_FILES = 100_000
"""Files a manifest may list: a save writes one shard file per rank and four more (see [Note: bounds
on what is read] in :mod:`dspark.checkpoint.plain_files`)."""
SUMMARY_FIELDS = ("step_count", "world_size", "strategy", "precision", "optimizer", "num_params",
                  "dspark_version", "created_utc")
"""What the manifest repeats of ``dspark.json`` (what ``dspark ckpt verify`` prints)."""


def save_id_key(rank: int) -> str:
    """The checkpoint key of the save id that ``rank`` writes into its shard file."""
    return f"save/rank{rank}"


def id_tensor(save_id: str) -> torch.Tensor:
    """The save id as the tensor each rank writes (16 bytes).

    Example::

        id_tensor("0f" * 16).shape   # torch.Size([16])
    """
    return torch.tensor(list(bytes.fromhex(save_id)), dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file as its save wrote it."""

    size_bytes: int
    digest: str
    chunks: dict[tuple[int, int], str]
    """(offset, length) -> digest, covering the file from its first byte to its last."""
    id_record: tuple[int, int] | None = None
    """(offset, length) of the ``save/rank<R>`` record in a shard file."""

    def as_json(self, hash_name: str) -> dict[str, Any]:
        """The entry in ``manifest.json``: its digest under the hash's name (``"blake3": ...``)."""
        return {"bytes": self.size_bytes, hash_name: self.digest,
                "chunks": [[offset, length, d] for (offset, length), d in sorted(self.chunks.items())],
                **({"id_record": list(self.id_record)} if self.id_record else {})}


@dataclass(frozen=True, slots=True)
class Manifest:
    """What ``manifest.json`` says."""

    save_id: str
    summary: dict[str, Any]
    files: dict[str, FileEntry]
    directory: Path
    hash_name: str
    """The hash of every digest in it (one of :data:`dspark.checkpoint.digest.HASH_NAMES`)."""
    file_sha256: str = ""
    """sha256 of ``manifest.json`` itself: one value that identifies every byte of the checkpoint."""

    def entry(self, name: str) -> FileEntry:
        if name not in self.files:
            raise CheckpointIntegrityError(f"{str(self.directory / name)!r} is not a file this save wrote "
                                           f"(its {MANIFEST_FILE} lists {sorted(self.files)})")
        return self.files[name]


def file_chunks(size_bytes: int, records: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The chunks of a file of ``size_bytes``: its records (offset, length) and the bytes between
    and after them, in file order. ``AssertionError`` when records overlap or pass the end.

    Example::

        file_chunks(10, [(2, 3)])   # [(0, 2), (2, 3), (5, 5)]
    """
    chunks, at = [], 0
    for offset, length in sorted(set(records)):
        if offset < at:
            raise AssertionError(f"records overlap at byte {offset}")
        if offset > at:
            chunks.append((at, offset - at))
        chunks.append((offset, length))
        at = offset + length
    if at > size_bytes:
        raise AssertionError(f"a record ends at byte {at}, after the file's end ({size_bytes})")
    if at < size_bytes or not chunks:
        chunks.append((at, size_bytes - at))
    return chunks


def hash_files(directory: Path, records: dict[str, list[tuple[int, int]]],
               id_records: dict[str, tuple[int, int]], *,
               hash_name: str = digest.HASH_NAME) -> dict[str, FileEntry]:
    """Each named file's entry: ``records`` maps a file to its records (from DCP's metadata; a
    JSON file has none), ``id_records`` a shard file to its save-id record; its digests are
    ``hash_name``'s (what a save writes, unless a test needs an older manifest).

    Example::

        hash_files(Path("ck.tmp"), {"dspark.json": []}, {})["dspark.json"].size_bytes
    """
    entries = {}
    for name, file_records in sorted(records.items()):
        path = directory / name
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            size_bytes = check_plain_file(path).st_size
            chunks = digest.hash_ranges(fd, file_chunks(size_bytes, file_records), hash_name)
        finally:
            os.close(fd)
        entries[name] = FileEntry(size_bytes=size_bytes, chunks=chunks, id_record=id_records.get(name),
                                  digest=digest.file_digest([d for _, d in sorted(chunks.items())],
                                                            hash_name))
    return entries


def build_manifest(directory: Path, *, save_id: str, summary: dict[str, Any],
                   files: dict[str, FileEntry], hash_name: str = digest.HASH_NAME) -> dict[str, Any]:
    """The JSON of a manifest (what :func:`write_manifest` writes); ``hash_name``: the hash of the
    digests in ``files``."""
    return {"format": _FORMAT, "version": _VERSION, "save_id": save_id,
            "hash": digest.check_hash_name(hash_name), "piece_bytes": digest.PIECE_BYTES,
            "checkpoint": {k: summary[k] for k in SUMMARY_FIELDS},
            "files": {name: entry.as_json(hash_name) for name, entry in sorted(files.items())}}


def write_manifest(directory: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (from :func:`build_manifest`) as ``directory/manifest.json`` (rank 0, last
    before publication)."""
    write_json(directory / MANIFEST_FILE, payload)


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest of the checkpoint in ``directory``; None when it has none (format 2, or
    removed: the caller decides by the format); :class:`CheckpointIntegrityError` when it is not a
    manifest DSpark wrote; :class:`CheckpointError` when it is over its bound (see [Note: bounds on
    what is read] in :mod:`dspark.checkpoint.plain_files`). Parsed once per process: a load reads it
    in several places (see [Note: the manifest is parsed once]).

    Example::

        read_manifest(Path("ckpt")).save_id   # '6f1c...'
    """
    path = directory / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = read_plain_file(path, MANIFEST)
        identity = (str(directory), digest.chunk_digest(data, "sha256"))
        known = _parsed.get(identity)
        if known is not None:
            return known
        manifest = _parse(json.loads(data.decode("utf-8")), directory, file_sha256=identity[1])
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointIntegrityError(f"{str(path)!r} is damaged: it is not a manifest DSpark wrote "
                                       f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    if len(_parsed) >= 4:
        _parsed.pop(next(iter(_parsed)))
    _parsed[identity] = manifest
    return manifest


# [Note: the manifest is parsed once] A load reads the manifest where it checks dspark.json, where it
# checks training_state.json, where it checks DCP's .metadata and where it checks each record, and an
# export again for each shard it writes: each read parsed it afresh. The last few manifests parsed are
# kept by their directory and the sha256 of their bytes (hashing is far cheaper than parsing, and
# needed anyway: the digest identifies the checkpoint), so the same bytes are parsed once per
# process, and a manifest changed on disk, even within the file system's timestamp resolution, is
# parsed anew.
_parsed: dict[tuple[str, str], Manifest] = {}


def _parse(raw: Any, directory: Path, *, file_sha256: str) -> Manifest:
    if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
        raise ValueError(f"no \"format\": {_FORMAT!r}")
    try:
        hash_name = digest.check_hash_name(raw.get("hash"))
    except ValueError as exc:   # no damage to report: this DSpark cannot check the files
        raise CheckpointIntegrityError(f"{str(directory / MANIFEST_FILE)!r}: {exc}; its files cannot "
                                       "be verified, so it is not loaded") from exc
    if raw.get("version") != _VERSION or raw.get("piece_bytes") != digest.PIECE_BYTES:
        raise ValueError(f"version {raw.get('version')!r}, piece_bytes {raw.get('piece_bytes')!r}: "
                         f"this DSpark reads version {_VERSION}, {digest.PIECE_BYTES}")
    save_id = raw["save_id"]
    if not isinstance(save_id, str) or len(save_id) != 32 or any(c not in "0123456789abcdef" for c in save_id):
        raise ValueError(f"save_id={save_id!r} is not 32 hex digits")
    summary = raw["checkpoint"]
    if not isinstance(summary, dict) or set(summary) != set(SUMMARY_FIELDS):
        raise ValueError(f"checkpoint must hold {list(SUMMARY_FIELDS)}")
    if not isinstance(raw["files"], dict) or len(raw["files"]) > MAX_MANIFEST_FILES:
        listed = len(raw["files"]) if isinstance(raw["files"], dict) else raw["files"]
        raise CheckpointError(f"{str(directory / MANIFEST_FILE)!r} lists {listed!r:.60} files, more than "
                              f"the {MAX_MANIFEST_FILES} DSpark reads (see 'Bounds on what is read' in "
                              "docs/checkpoints.md): it is damaged or was crafted")
    files = {}
    for name, item in raw["files"].items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ValueError(f"file name {name!r} is not a name inside the checkpoint")
        size_bytes = _count(item["bytes"])
        chunks = {(_count(o), _count(n)): _hex(d) for o, n, d in item["chunks"]}
        if file_chunks(size_bytes, list(chunks)) != sorted(chunks):
            raise ValueError(f"the chunks of {name!r} do not cover its {size_bytes} bytes exactly")
        id_record = item.get("id_record")
        files[name] = FileEntry(size_bytes=size_bytes, digest=_hex(item[hash_name]), chunks=chunks,
                                id_record=None if id_record is None else (_count(id_record[0]),
                                                                          _count(id_record[1])))
    return Manifest(save_id=save_id, summary=summary, files=files, directory=directory,
                    hash_name=hash_name, file_sha256=file_sha256)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a byte count")
    return value


def _hex(value: Any) -> str:
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ValueError(f"{value!r} is not a digest (64 hex digits)")
    return value


def read_verified(directory: Path, name: str, manifest: Manifest | None, bound: Bound) -> bytes:
    """The bytes of ``directory/name`` (a plain file within ``bound``), checked against ``manifest``
    before anyone parses them; unchecked when there is no manifest (see [Note: checkpoint integrity]).

    Example::

        json.loads(read_verified(Path("ckpt"), "dspark.json", read_manifest(Path("ckpt")), DSPARK_JSON))
    """
    data = read_plain_file(directory / name, bound)
    if manifest is not None:
        check_bytes(manifest, name, data)
    return data


def check_bytes(manifest: Manifest, name: str, data: bytes) -> None:
    """:class:`CheckpointIntegrityError` naming the file unless ``data`` is exactly what the save
    wrote as ``name`` (a file read whole: JSON or ``.metadata``).

    Example::

        check_bytes(manifest, ".metadata", (directory / ".metadata").read_bytes())
    """
    entry = manifest.entry(name)
    if len(data) != entry.size_bytes \
            or digest.chunk_digest(data, manifest.hash_name) != entry.chunks.get((0, len(data))):
        raise CheckpointIntegrityError(f"{str(manifest.directory / name)!r} is damaged or not this "
                                       f"checkpoint's: {_which_save(data, manifest)}")


def _which_save(data: bytes, manifest: Manifest) -> str:
    """Why a JSON file does not match, in words: written by another save, or changed since."""
    try:
        theirs = json.loads(data.decode("utf-8")).get("save_id")
    except (UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        theirs = None
    if isinstance(theirs, str) and theirs != manifest.save_id:
        return (f"it was written by another save (save id {theirs}; this checkpoint's is "
                f"{manifest.save_id}): files of two checkpoints were mixed")
    return ("its content differs from what the save wrote (edited, or damaged, since); "
            f"{MANIFEST_FILE} holds the digest of the original")
