"""Content digests of a checkpoint's files, computed in worker threads beside the reading.

[Note: checkpoint digests] A file is split into *chunks*: in a shard file, each record DCP wrote
(one tensor's chunk, at the offset and length its ``.metadata`` gives) and any bytes between records;
in a JSON file or ``.metadata``, the whole file. A chunk's digest is the hash of its bytes when it
has at most :data:`PIECE_BYTES`, else the hash of the digests of its :data:`PIECE_BYTES`-long
pieces (so that the pieces of one large tensor are hashed on several cores at once). A file's
digest is the hash of its chunks' digests in file order. The hash is the manifest's ``"hash"``:
BLAKE3 for every save (:data:`HASH_NAME`); sha256 in manifests written before, which still verify
(:data:`HASH_NAMES`). Both are cryptographic, so the manifest stays a tamper-evident record of every
byte; BLAKE3 hashes much faster per core than sha256 even with the SHA extensions (its SIMD
code runs 8 or 16 blocks at once with AVX2/AVX-512), which is what lets a load's check overlap the
load instead of adding to it.

Chunks follow DCP's records so that a load checks exactly the bytes it reads, in the same pass: DCP
reads whole records, each loading rank only those it needs. Both hashes release the GIL while they
hash, so a :class:`Hasher`'s threads hash while the caller's thread goes on reading and unpickling
tensors. Each worker reads the range it hashes itself (``pread`` into a buffer it reuses), so the
reading thread keeps DCP's own fast path: the second read is a copy out of the page cache, on the
worker's core; handing the worker the bytes DCP read would instead put a fresh buffer (page faults)
and a copy on the reading thread, the one that sets the load's time.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

__all__ = ["HASH_NAME", "HASH_NAMES", "PIECE_BYTES", "Hasher", "check_hash_name", "chunk_digest",
           "file_digest", "spare_threads"]

HASH_NAME = "blake3"
"""The hash every save writes its manifest with (recorded there as ``"hash"``)."""
HASH_NAMES = ("blake3", "sha256")
"""The hashes a manifest may name: sha256 is what manifests said before BLAKE3."""
PIECE_BYTES = 8 * 2**20
"""Chunks longer than this are hashed as pieces of this length (see [Note: checkpoint digests])."""
_READ_BYTES = 2**20
"""A worker reads its piece this much at a time and hashes each part while it is still in the
CPU's cache, instead of reading the whole piece first (faster, as measured with BLAKE3)."""


class _HashObject(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def digest(self) -> bytes: ...


_NewHash = Callable[[], _HashObject]


def check_hash_name(name: object) -> str:
    """``name`` if it is a hash DSpark reads, else ``ValueError`` naming it and the known ones.

    Example::

        check_hash_name("blake3")   # 'blake3'
    """
    if not isinstance(name, str) or name not in HASH_NAMES:
        raise ValueError(f"hash {name!r} is not one this DSpark knows ({', '.join(map(repr, HASH_NAMES))}): "
                         "the manifest was written by a newer DSpark (upgrade) or is damaged")
    return name


def _new_hash(name: str) -> _NewHash:
    """What starts a hash of ``name``, fed with ``update`` in one thread (the pieces are spread
    over threads already)."""
    if check_hash_name(name) == "sha256":
        return hashlib.sha256
    try:
        from blake3 import blake3  # a dependency of DSpark; imported when a checkpoint is hashed
    except ImportError as exc:
        raise ImportError("checkpoints are hashed with BLAKE3, from the 'blake3' package, which is "
                          "missing: pip install -c constraints.txt -e . (or pip install blake3)") from exc
    return blake3


def _hash_function(name: str) -> Callable[[bytes | memoryview], bytes]:
    new = _new_hash(name)

    def hash_bytes(data: bytes | memoryview) -> bytes:
        hashed = new()
        hashed.update(data)
        return hashed.digest()

    return hash_bytes


def _pieces(data: bytes | memoryview) -> Iterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(view), PIECE_BYTES):
        yield view[start:start + PIECE_BYTES]


def _combine(piece_digests: list[bytes], hash_name: str) -> str:
    if len(piece_digests) == 1:
        return piece_digests[0].hex()
    return _hash_function(hash_name)(b"".join(piece_digests)).hex()


def chunk_digest(data: bytes | memoryview, hash_name: str = HASH_NAME) -> str:
    """The digest of one chunk's bytes, hashed in this thread.

    Example::

        chunk_digest(b"{}", "sha256")   # '44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a'
    """
    hash_function = _hash_function(hash_name)
    if len(data) <= PIECE_BYTES:
        return hash_function(data).hex()
    return _combine([hash_function(piece) for piece in _pieces(data)], hash_name)


def file_digest(chunk_digests: list[str], hash_name: str = HASH_NAME) -> str:
    """A file's digest from its chunks' digests, in file order.

    Example::

        file_digest([chunk_digest(b"{}")])
    """
    return _hash_function(hash_name)(b"".join(bytes.fromhex(d) for d in chunk_digests)).hex()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _default_threads() -> int:
    return max(1, min(8, _cores()))


def spare_threads() -> int:
    """Hash threads for a load: one per core the reading thread leaves free (at least one, at most
    8). A thread more would take turns with the reading thread on its core, and the reading thread
    sets the load's time.

    Example::

        Hasher("blake3", threads=spare_threads())
    """
    return max(1, min(8, _cores() - 1))


_buffers = threading.local()


def _hash_piece(new_hash: _NewHash, fd: int, offset: int, size: int) -> bytes:
    """The hash of ``size`` bytes of ``fd`` at ``offset``, read :data:`_READ_BYTES` at a time into
    this thread's own buffer (no allocation per piece: a fresh buffer costs page faults on every
    use)."""
    buffer = getattr(_buffers, "part", None)
    if buffer is None:
        buffer = _buffers.part = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    hashed = new_hash()
    done = 0
    while done < size:
        got = os.preadv(fd, [view[:min(_READ_BYTES, size - done)]], offset + done)
        if got <= 0:
            raise EOFError(f"the file ends at byte {offset + done}, inside bytes {offset}-{offset + size}")
        hashed.update(view[:got])
        done += got
    return hashed.digest()


class Hasher:
    """Hashes byte ranges of open files in worker threads (each reads its pieces itself, with
    ``pread``), while the caller goes on; :meth:`results` waits for them.

    Example::

        with Hasher("blake3") as hasher:
            hasher.add_range("a", fd, 0, 4096)
            digests = hasher.results()   # {'a': '...'}
    """

    def __init__(self, hash_name: str = HASH_NAME, *, threads: int | None = None) -> None:
        self._hash_name = hash_name
        self._new_hash = _new_hash(hash_name)
        self._pool = ThreadPoolExecutor(max_workers=threads or _default_threads(),
                                        thread_name_prefix="dspark-digest")
        self._chunks: dict[object, list[Future[bytes]]] = {}

    def add_range(self, key: object, fd: int, offset: int, length: int) -> None:
        """Start hashing bytes ``offset``..``offset + length`` of the open file ``fd`` as chunk
        ``key`` (any hashable); ``fd`` must stay open until :meth:`results` returns."""
        if key in self._chunks:
            raise AssertionError(f"chunk {key!r} was added twice")
        starts = range(offset, offset + length, PIECE_BYTES) if length else [offset]
        self._chunks[key] = [self._pool.submit(_hash_piece, self._new_hash, fd, start,
                                               min(PIECE_BYTES, offset + length - start))
                             for start in starts]

    def results(self) -> dict[object, str]:
        """Every chunk's digest, by key, once all are hashed; ``EOFError`` when a file ended
        before a range did."""
        return {key: _combine([f.result() for f in futures], self._hash_name)
                for key, futures in self._chunks.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hash_ranges(fd: int, ranges: list[tuple[int, int]],
                hash_name: str = HASH_NAME) -> dict[tuple[int, int], str]:
    """The digest of each ``(offset, length)`` byte range of the open file ``fd``, hashed in worker
    threads; ``EOFError`` when the file ends before a range does.

    Example::

        fd = os.open("ckpt/__0_0.distcp", os.O_RDONLY)
        hash_ranges(fd, [(0, 1024), (1024, 4096)])
    """
    with Hasher(hash_name) as hasher:
        for offset, length in ranges:
            hasher.add_range((offset, length), fd, offset, length)
        return {key: digest for key, digest in hasher.results().items()}  # type: ignore[misc]
