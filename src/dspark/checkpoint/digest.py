"""Content digests of a checkpoint's files, computed in worker threads beside the reading.

[Note: checkpoint digests] A file is split into *chunks*: in a shard file, each record DCP wrote
(one tensor's chunk, at the offset and length its ``.metadata`` gives) and any bytes between records;
in a JSON file or ``.metadata``, the whole file. A chunk's digest is the sha256 of its bytes when it
has at most :data:`PIECE_BYTES`, else the sha256 of the sha256 digests of its
:data:`PIECE_BYTES`-long pieces (so that the pieces of one large tensor are hashed on several cores
at once). A file's digest is the sha256 of its chunks' digests in file order.

Chunks follow DCP's records so that a load checks exactly the bytes it reads, in the same pass: DCP
reads whole records, each loading rank only those it needs. sha256 runs at about 1 GB/s per core
with the SHA extensions of current x86 and Arm CPUs (measured: docs/checkpoints.md); ``hashlib``
releases the GIL while it hashes, so a :class:`Hasher`'s threads hash while the caller's thread
goes on reading and unpickling tensors.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

__all__ = ["HASH_NAME", "PIECE_BYTES", "Hasher", "chunk_digest", "file_digest"]

HASH_NAME = "sha256"
PIECE_BYTES = 8 * 2**20
"""Chunks longer than this are hashed as pieces of this length (see [Note: checkpoint digests])."""


def _pieces(data: bytes | memoryview) -> Iterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(view), PIECE_BYTES):
        yield view[start:start + PIECE_BYTES]


def _sha256(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


def _combine(piece_digests: list[bytes]) -> str:
    if len(piece_digests) == 1:
        return piece_digests[0].hex()
    return hashlib.sha256(b"".join(piece_digests)).hexdigest()


def chunk_digest(data: bytes | memoryview) -> str:
    """The digest of one chunk's bytes, hashed in this thread.

    Example::

        chunk_digest(b"{}")   # '44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a'
    """
    if len(data) <= PIECE_BYTES:
        return _sha256(data).hex()
    return _combine([_sha256(piece) for piece in _pieces(data)])


def file_digest(chunk_digests: list[str]) -> str:
    """A file's digest from its chunks' digests, in file order.

    Example::

        file_digest([chunk_digest(b"{}")])
    """
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in chunk_digests)).hexdigest()


def _default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class Hasher:
    """Hashes chunks in worker threads while the caller reads on; :meth:`results` waits for them.
    At most ``max_pending_bytes`` wait at a time (the caller blocks in :meth:`add` beyond that), so
    hashing a large file never holds more than that in memory.

    Example::

        with Hasher() as hasher:
            hasher.add("a", b"bytes of chunk a")
            digests = hasher.results()   # {'a': '...'}
    """

    def __init__(self, *, threads: int | None = None, max_pending_bytes: int = 256 * 2**20) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads or _default_threads(),
                                        thread_name_prefix="dspark-digest")
        self._max_pending_bytes = max_pending_bytes
        self._pending: deque[tuple[int, Future[bytes]]] = deque()
        self._pending_bytes = 0
        self._chunks: dict[object, list[Future[bytes]]] = {}

    def add(self, key: object, data: bytes | memoryview) -> None:
        """Hash ``data`` as the next part of chunk ``key`` (any hashable: a name, an offset). A chunk
        may come in several parts, each but the last a multiple of :data:`PIECE_BYTES` long."""
        futures = self._chunks.setdefault(key, [])
        for piece in _pieces(data) if len(data) else [memoryview(b"")]:
            while self._pending and self._pending_bytes + len(piece) > self._max_pending_bytes:
                size, oldest = self._pending.popleft()
                oldest.result()
                self._pending_bytes -= size
            future = self._pool.submit(_sha256, piece)
            futures.append(future)
            self._pending.append((len(piece), future))
            self._pending_bytes += len(piece)

    def results(self) -> dict[object, str]:
        """Every chunk's digest, by key, once all are hashed."""
        return {key: _combine([f.result() for f in futures]) for key, futures in self._chunks.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hash_ranges(stream: BinaryIO, ranges: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """The digest of each ``(offset, length)`` byte range of ``stream``, read in file order a piece
    at a time and hashed in worker threads; ``OSError`` when the file ends before a range does.

    Example::

        with open("ckpt/__0_0.distcp", "rb") as f:
            hash_ranges(f, [(0, 1024), (1024, 4096)])
    """
    with Hasher() as hasher:
        for offset, length in sorted(ranges):
            stream.seek(offset)
            done = 0
            while done < length or (length == 0 and done == 0):
                data = stream.read(min(PIECE_BYTES, length - done))
                if len(data) != min(PIECE_BYTES, length - done):
                    raise OSError(f"{getattr(stream, 'name', 'the file')!r} ended at byte "
                                  f"{offset + done + len(data)}, inside the range {offset}-{offset + length}")
                hasher.add((offset, length), data)
                done += len(data)
                if length == 0:
                    break
        return {key: digest for key, digest in hasher.results().items()}  # type: ignore[misc]
