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
goes on reading and unpickling tensors. Each worker reads the range it hashes itself (``pread``
into a buffer it reuses), so the reading thread keeps DCP's own fast path.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

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


_buffers = threading.local()


def _hash_piece(fd: int, offset: int, size: int) -> bytes:
    """sha256 of ``size`` bytes of ``fd`` at ``offset``, read into this thread's own buffer (no
    allocation per piece: a fresh large buffer costs page faults on every use)."""
    buffer = getattr(_buffers, "piece", None)
    if buffer is None:
        buffer = _buffers.piece = bytearray(PIECE_BYTES)
    view = memoryview(buffer)[:size]
    done = 0
    while done < size:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise EOFError(f"the file ends at byte {offset + done}, inside bytes {offset}-{offset + size}")
        done += got
    return _sha256(view)


class Hasher:
    """Hashes byte ranges of open files in worker threads (each reads its pieces itself, with
    ``pread``), while the caller goes on; :meth:`results` waits for them.

    Example::

        with Hasher() as hasher:
            hasher.add_range("a", fd, 0, 4096)
            digests = hasher.results()   # {'a': '...'}
    """

    def __init__(self, *, threads: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads or _default_threads(),
                                        thread_name_prefix="dspark-digest")
        self._chunks: dict[object, list[Future[bytes]]] = {}

    def add_range(self, key: object, fd: int, offset: int, length: int) -> None:
        """Start hashing bytes ``offset``..``offset + length`` of the open file ``fd`` as chunk
        ``key`` (any hashable); ``fd`` must stay open until :meth:`results` returns."""
        if key in self._chunks:
            raise AssertionError(f"chunk {key!r} was added twice")
        starts = range(offset, offset + length, PIECE_BYTES) if length else [offset]
        self._chunks[key] = [self._pool.submit(_hash_piece, fd, start, min(PIECE_BYTES, offset + length - start))
                             for start in starts]

    def results(self) -> dict[object, str]:
        """Every chunk's digest, by key, once all are hashed; ``EOFError`` when a file ended
        before a range did."""
        return {key: _combine([f.result() for f in futures]) for key, futures in self._chunks.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hash_ranges(fd: int, ranges: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
    """The digest of each ``(offset, length)`` byte range of the open file ``fd``, hashed in worker
    threads; ``EOFError`` when the file ends before a range does.

    Example::

        fd = os.open("ckpt/__0_0.distcp", os.O_RDONLY)
        hash_ranges(fd, [(0, 1024), (1024, 4096)])
    """
    with Hasher() as hasher:
        for offset, length in ranges:
            hasher.add_range((offset, length), fd, offset, length)
        return {key: digest for key, digest in hasher.results().items()}  # type: ignore[misc]
