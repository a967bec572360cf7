"""Collectives through shared memory, for CPU ranks that share one machine.

gloo moves every byte between two processes of one host through TCP over loopback: a copy into the
kernel, a copy out, the protocol's work, on a thread that shares the core with the compute. Here
each rank writes its input once into its own region of one shared mapping and reads the other
ranks' regions where they are, in a fraction of gloo's time for the same bytes (`dspark run
--nproc 2 benchmarks/shm_collectives.py`: docs/figures.md#shm-collectives).
See [Note: the shared-memory transport].

Only :mod:`dspark.comm.shm_setup` builds a transport, for the default group of a gloo job whose
ranks all run on this machine (:mod:`dspark.comm.collectives` runs the group's collectives on it)
(x86-64: its stores reach other cores in program order, which is what publishing a sequence number
after the data relies on). ``DSPARK_SHM=0`` turns it off.
"""

from __future__ import annotations

import functools
import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from dspark.comm.failures import describe, timeout_error
from dspark.errors import CollectiveError, CollectiveTimeoutError

__all__ = ["ALIGN", "DTYPE_CODES", "SHM_ENV", "SHM_MB_ENV", "ShmOp", "ShmTransport", "ShmWork", "label_text",
           "label_words", "mapping_bytes"]

SHM_ENV = "DSPARK_SHM"
SHM_MB_ENV = "DSPARK_SHM_MB"
ALIGN = 64
_HEADERS = 128           # headers kept per rank: at most this many collectives in flight
_LABEL_WORDS = 6         # the caller's label for the collective, 48 bytes of UTF-8 at most
_HEADER_WORDS = 6 + _LABEL_WORDS   # seq, kind, nbytes, offset, dtype, numel, label
_CTRL_WORDS = 16 + _HEADERS * _HEADER_WORDS
_CTRL_BYTES = -(-_CTRL_WORDS * 8 // 4096) * 4096   # each rank's control block on its own pages
_ARRIVED, _CONSUMED = 0, 8   # words of the control block, on separate cache lines
_KINDS = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "broadcast": 4}
_KIND_NAMES = {code: name for name, code in _KINDS.items()}
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES, start=1)}


@functools.lru_cache(maxsize=1024)
def label_words(label: str) -> tuple[int, ...]:
    """``label`` as the header's label words: its first 48 bytes of UTF-8, zero-padded."""
    raw = label.encode()[:8 * _LABEL_WORDS].ljust(8 * _LABEL_WORDS, b"\0")
    return tuple(int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8))


def label_text(words: Sequence[int]) -> str:
    """The label :func:`label_words` wrote."""
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode(errors="replace")

# [Note: the shared-memory transport]
# One mapping of W control blocks and W data regions of R bytes (``DSPARK_SHM_MB``, 16 by default).
# Collective number k on rank r: reserve room in r's region (a ring: room is given back once every
# rank has consumed the collective that used it), copy the input there, write header k (kind, bytes,
# offset, dtype, and the caller's label), then publish arrived[r] = k. That is the launch; it never
# waits for another rank unless r's region or header ring is full. wait() spins until every rank
# has arrived at k, checks that their headers describe the same collective (a mismatch is a
# CollectiveError naming both sides, labels included, where gloo would hang or mix the bytes), reads
# the regions it needs (an all-reduce sums
# every rank's input in rank order, so every rank gets the same bits), then publishes
# consumed[r] = k. Collectives complete in launch order: waiting on k first completes those before
# it, so "consumed k" means every collective up to k. A rank whose region is full completes its own
# oldest collectives while it waits for room: every rank has arrived at those (they were launched
# before this one everywhere), so the wait always ends. A collective runs as pieces of at most a
# quarter of a region, each a collective of its own in the sequence: a message of any size streams
# through a small region.


_TOKEN = 15   # word of rank 0's control block: the creator's token, read back by every rank


def mapping_bytes(world_size: int, region: int) -> int:
    return world_size * (_CTRL_BYTES + region)


Finish = Callable[[list[torch.Tensor], "torch.Tensor | None"], None]
"""Completes a piece from every rank's input (and, for a gather, all of them as one strided view
when they share an offset)."""


class ShmWork:
    """One piece of a collective: its place in the sequence and what completing it does. ``nbytes``
    and ``label`` are the whole collective's (what a message names), not the piece's."""

    __slots__ = ("_finish", "done", "error", "kind", "label", "nbytes", "seq")

    def __init__(self, seq: int, kind: str, nbytes: int, finish: Finish, label: str = "") -> None:
        self.seq = seq
        self.kind = kind
        self.nbytes = nbytes
        self.label = label
        self._finish = finish
        self.done = False
        self.error: CollectiveError | None = None

    def run(self, inputs: list[torch.Tensor], stacked: torch.Tensor | None) -> None:
        self._finish(inputs, stacked)
        self.done = True


class ShmOp:
    """A collective in flight: its pieces, completed in order by :meth:`wait`."""

    __slots__ = ("_last", "_transport", "_works")

    def __init__(self, transport: ShmTransport, works: list[ShmWork]) -> None:
        self._transport = transport
        self._works = works
        self._last = works[-1].seq

    def wait(self) -> bool:
        self._transport.complete_through(self._last)
        for work in self._works:
            if work.error is not None:   # raised on every wait, as a failed gloo work does
                raise work.error
        return True

    def is_completed(self) -> bool:
        return all(work.done or work.error is not None for work in self._works)


class ShmTransport:
    """All-reduce, all-gather and reduce-scatter of CPU tensors between ``size`` ranks of one
    machine, through one shared mapping (see [Note: the shared-memory transport])."""

    def __init__(self, path: str, rank: int, size: int, region: int, timeout_s: float) -> None:
        self.rank, self.size, self.region, self.timeout_s = rank, size, region, timeout_s
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, mapping_bytes(size, region))
        finally:
            os.close(fd)
        self._ctrl = [np.frombuffer(self._mm, dtype=np.int64, count=_CTRL_WORDS,
                                    offset=r * _CTRL_BYTES) for r in range(size)]
        self._data0 = size * _CTRL_BYTES
        self._seq = int(self._ctrl[rank][_ARRIVED])  # 0 in a fresh mapping
        self._head = 0
        self._held: deque[tuple[int, int]] = deque()   # (seq, start) of this rank's region in use
        self._pending: deque[ShmWork] = deque()
        self.piece_bytes = max(ALIGN, region // 4 // ALIGN * ALIGN)
        self._peers: dict[int, int] = {}   # rank -> pid, watched while this rank waits

    def watch(self, pids: list[int]) -> None:
        """Watch the other ranks' processes while waiting on them, so that a rank that died stops
        the wait at once (gloo notices a closed connection the same way) instead of at the timeout.
        Only when every one of them is visible from here (one process namespace)."""
        peers = {r: pid for r, pid in enumerate(pids) if r != self.rank}
        self._peers = peers if all(_alive(pid) for pid in peers.values()) else {}

    def stamp(self, token: int) -> None:
        """Rank 0 writes ``token`` where every rank reads it (:meth:`sees`): the proof that all
        ranks mapped the same memory, not a file of the same name on another machine."""
        self._ctrl[0][_TOKEN] = token

    def sees(self, token: int) -> bool:
        return int(self._ctrl[0][_TOKEN]) == token

    # -- the collectives ------------------------------------------------------------------------
    # Each runs as pieces of at most a quarter of a region, so a message of any size streams through
    # the ring while up to four pieces are in flight.
    # ``label`` (the caller's name for the collective, e.g. ``dspark.gather.blocks.0``) travels in the
    # header, so that ranks that called different collectives are told which ones.
    def all_reduce(self, tensor: torch.Tensor, op: str, *, label: str | None = None) -> ShmOp:
        flat = tensor.view(-1)

        def piece(a: int, b: int) -> tuple[torch.Tensor, Finish]:
            return flat[a:b], lambda inputs, _: _reduce(op, inputs, flat[a:b])

        return self._pieces("all_reduce", flat.numel(), flat.element_size(), piece, label)

    def broadcast(self, tensor: torch.Tensor, src: int, *, label: str | None = None) -> ShmOp:
        """Rank ``src``'s ``tensor`` into every rank's, in place. Every rank publishes its own (so
        the headers compare as for any collective) and reads only ``src``'s."""
        flat = tensor.view(-1)
        mine = self.rank == src

        def piece(a: int, b: int) -> tuple[torch.Tensor, Finish]:
            def finish(inputs: list[torch.Tensor], _: torch.Tensor | None) -> None:
                if not mine:
                    flat[a:b].copy_(inputs[src])

            return flat[a:b], finish

        return self._pieces("broadcast", flat.numel(), flat.element_size(), piece, label)

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, *, label: str | None = None) -> ShmOp:
        return self.all_gather_parts([shard], [output], label=label)

    def all_gather_parts(self, parts: list[torch.Tensor], outputs: list[torch.Tensor], *,
                         label: str | None = None) -> ShmOp:
        """Output ``i`` gets every rank's ``parts[i]`` in rank order: one collective for all of
        them, written from the parts and read into the outputs, with no packed copy between."""
        flats = [p.reshape(-1) for p in parts]
        sizes = [f.numel() for f in flats]
        starts = [0]
        for k in sizes:
            starts.append(starts[-1] + k)
        rows = [o.view(self.size, k) for o, k in zip(outputs, sizes, strict=True)]

        def piece(a: int, b: int) -> tuple[list[torch.Tensor], Finish]:
            spans = [(i, max(a, s) - s, min(b, s + k) - s)
                     for i, (s, k) in enumerate(zip(starts, sizes, strict=False)) if s < b and s + k > a]

            def finish(inputs: list[torch.Tensor], stacked: torch.Tensor | None) -> None:
                if stacked is not None:   # every part of every rank in one copy (one dispatch)
                    torch.split_with_sizes_copy(stacked, [hi - lo for _, lo, hi in spans], dim=1,
                                                out=[rows[i][:, lo:hi] for i, lo, hi in spans])
                    return
                for r, got in enumerate(inputs):
                    at = 0
                    for i, lo, hi in spans:
                        rows[i][r, lo:hi].copy_(got[at:at + hi - lo])
                        at += hi - lo

            # a gather of nothing (a rank's empty shard) is still one collective: an empty piece
            return [flats[i][lo:hi] for i, lo, hi in spans] or [flats[0][:0]], finish

        return self._pieces("all_gather", starts[-1], flats[0].element_size(), piece, label)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       label: str | None = None) -> ShmOp:
        out = output.view(-1)
        chunks = input.reshape(self.size, out.numel())   # rank r gets the sum of every rank's row r
        size, r = self.size, self.rank

        def piece(a: int, b: int) -> tuple[torch.Tensor, Finish]:
            def finish(inputs: list[torch.Tensor], _: torch.Tensor | None) -> None:
                _reduce("sum", [t.view(size, b - a)[r] for t in inputs], out[a:b])

            return chunks[:, a:b], finish

        return self._pieces("reduce_scatter", out.numel(), out.element_size() * size, piece, label)

    def _pieces(self, kind: str, numel: int, bytes_per_element: int,
                piece: Callable[[int, int], tuple[torch.Tensor | list[torch.Tensor], Finish]],
                label: str | None) -> ShmOp:
        step = max(1, self.piece_bytes // bytes_per_element)
        words = label_words(label or "")
        works = [self._launch(kind, *piece(a, min(a + step, numel)), words)
                 for a in range(0, max(numel, 1), step)]
        for work in works:   # a timeout names the whole collective
            work.nbytes, work.label = numel * bytes_per_element, label or ""
        return ShmOp(self, works)

    # -- launch and completion -------------------------------------------------------------------
    def _launch(self, kind: str, src: torch.Tensor | list[torch.Tensor],
                finish: Finish, label: tuple[int, ...] = (0,) * _LABEL_WORDS) -> ShmWork:
        """Put ``src`` (a tensor, or tensors laid end to end) in this rank's region as collective
        number k and publish it; ``finish`` reads every rank's copy when the collective completes."""
        srcs = [src] if isinstance(src, torch.Tensor) else src
        dtype = srcs[0].dtype
        if dtype not in DTYPE_CODES or any(t.dtype != dtype for t in srcs):
            raise CollectiveError(f"rank {self.rank}: {kind} of dtype {dtype} is not supported "
                                  f"by the shared-memory transport; set {SHM_ENV}=0 to use gloo")
        numel = sum(t.numel() for t in srcs)
        nbytes = numel * srcs[0].element_size()
        seq = self._seq + 1
        start = self._reserve(seq, nbytes)
        ring = self._view(self.rank, start, nbytes, dtype)
        if len(srcs) == 1:
            ring.view(srcs[0].shape).copy_(srcs[0])
        elif numel:   # a gather's parts, laid end to end in one copy (one dispatch, not one each)
            torch.cat([t.reshape(-1) for t in srcs], out=ring)
        me = self._ctrl[self.rank]
        base = 16 + (seq % _HEADERS) * _HEADER_WORDS
        me[base:base + _HEADER_WORDS] = (seq, _KINDS[kind], nbytes, start, DTYPE_CODES[dtype],
                                          numel, *label)
        me[_ARRIVED] = seq   # after the data and the header: x86 keeps the order
        self._seq = seq
        work = ShmWork(seq, kind, nbytes, finish)
        self._pending.append(work)
        return work

    def complete_through(self, seq: int) -> None:
        while self._pending and self._pending[0].seq <= seq:
            self._complete(self._pending[0])

    def _complete(self, work: ShmWork) -> None:
        self._spin(lambda: min(int(c[_ARRIVED]) for c in self._ctrl) >= work.seq,
                   f"{work.kind} of {work.nbytes} bytes (collective #{work.seq})",
                   lambda: self._late(work, _ARRIVED))
        try:
            inputs = [self._input(r, work) for r in range(self.size)]
            work.run(inputs, self._stacked(work, inputs))
        except CollectiveError as exc:   # kept for the caller's wait(), which may come later
            work.error = exc
        finally:
            self._pending.popleft()
            self._ctrl[self.rank][_CONSUMED] = work.seq   # after every read of the regions

    def _input(self, r: int, work: ShmWork) -> torch.Tensor:
        theirs = self._header(r, work.seq)
        seq, kind, nbytes, start, dtype = theirs[:5]
        if seq != work.seq:
            raise AssertionError(f"rank {self.rank}: header {work.seq} of rank {r} holds {seq}")
        mine = self._header(self.rank, work.seq)
        if (kind, nbytes, dtype) != (mine[1], mine[2], mine[4]):
            raise CollectiveError(
                f"rank {self.rank}: collective #{work.seq} is {self._describe(mine)} here and "
                f"{self._describe(theirs)} on rank {r}: the ranks "
                f"called different collectives (one rank took a branch the others did not, e.g. "
                f"an evaluation or a save on rank 0 alone); every rank must run the same "
                f"collectives in the same order")
        return self._view(r, start, nbytes, _DTYPES[dtype - 1])

    def _stacked(self, work: ShmWork, inputs: list[torch.Tensor]) -> torch.Tensor | None:
        """For a gather, every rank's input as one ``(N, numel)`` view when they sit at the same
        offset of their regions (ranks that ran the same collectives do): one copy reads them all."""
        starts = {self._header(r, work.seq)[3] for r in range(self.size)}
        dtype, numel = inputs[0].dtype, inputs[0].numel()
        size = inputs[0].element_size()
        if work.kind != "all_gather" or len(starts) != 1 or numel == 0 or self.region % size:
            return None
        assert self._mm is not None
        span = torch.frombuffer(self._mm, dtype=torch.uint8,
                                count=(self.size - 1) * self.region + numel * size,
                                offset=self._data0 + starts.pop()).view(dtype)
        return span.as_strided((self.size, numel), (self.region // size, 1))

    def _view(self, r: int, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Bytes of rank ``r``'s region as a tensor, made for one piece and dropped with it: the
        mapping is the transport's, like gloo's socket buffers, and no tensor of the training's
        holds it (it shows in the process's resident memory, not in a census of its tensors)."""
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        assert self._mm is not None, "the shared-memory transport is closed"
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes,
                                offset=self._data0 + r * self.region + start).view(dtype)

    def _header(self, r: int, seq: int) -> tuple[int, ...]:
        base = 16 + (seq % _HEADERS) * _HEADER_WORDS
        return tuple(int(v) for v in self._ctrl[r][base:base + _HEADER_WORDS])

    @staticmethod
    def _describe(header: tuple[int, ...]) -> str:
        dtype = _DTYPES[header[4] - 1] if 0 < header[4] <= len(_DTYPES) else "?"
        label = label_text(header[6:6 + _LABEL_WORDS])
        return f"{_KIND_NAMES.get(header[1], '?')} of {header[5]} x {dtype}" + (f" ({label})" if label else "")

    # -- room in this rank's region --------------------------------------------------------------
    def _reserve(self, seq: int, nbytes: int) -> int:
        size = _aligned(nbytes)
        while True:
            consumed = min(int(c[_CONSUMED]) for c in self._ctrl)
            while self._held and self._held[0][0] <= consumed:
                self._held.popleft()
            start = self._place(size) if seq - consumed <= _HEADERS else None
            if start is not None:
                self._held.append((seq, start))
                self._head = start + size
                return start
            if self._pending:        # finish our own oldest collective: every rank has launched it
                self._complete(self._pending[0])
                continue
            # every collective of ours is consumed here; the others have yet to read them
            self._spin(functools.partial(self._consumed_past, consumed),
                       f"collective #{seq}", lambda: self._late_room(seq))

    def _consumed_past(self, seq: int) -> bool:
        return min(int(c[_CONSUMED]) for c in self._ctrl) > seq

    def _place(self, size: int) -> int | None:
        if not self._held:
            self._head = 0
            return 0
        tail = self._held[0][1]
        if self._head > tail:
            if self._head + size <= self.region:
                return self._head
            return 0 if size <= tail else None
        if self._head < tail and self._head + size <= tail:
            return self._head
        return None   # head == tail with data held: the region is full

    # -- waiting ---------------------------------------------------------------------------------
    def _spin(self, ready: Callable[[], bool], what: str,
              late: Callable[[], CollectiveTimeoutError]) -> None:
        """Wait until ``ready()``: ``what`` names the wait, ``late()`` says who is missing."""
        if ready():
            return
        start = time.monotonic()
        deadline, look = start + self.timeout_s, start + 0.1
        pause = 0.0
        spins = 0
        while not ready():
            spins += 1
            if spins > 50:
                # the other ranks are busy computing: give the core back, a little longer each time
                pause = min(pause * 2 or 2e-6, 2e-4)
                time.sleep(pause)
                now = time.monotonic()
                if now > look:
                    look = now + 0.1
                    dead = [r for r, pid in self._peers.items() if not _alive(pid)]
                    if dead and not ready():
                        raise CollectiveError(
                            f"rank {self.rank}: {what} cannot complete: rank(s) "
                            f"{', '.join(map(str, dead))} exited while this rank waited on them "
                            f"(their own error is in their output)")
                if now > deadline:
                    raise late()

    def _late(self, work: ShmWork, word: int) -> CollectiveTimeoutError:
        missing = [r for r, c in enumerate(self._ctrl) if int(c[word]) < work.seq]
        return timeout_error(rank=self.rank, what=describe(work.kind, work.nbytes, work.label,
                                                           f"collective #{work.seq}"),
                             timeout_s=self.timeout_s, missing=missing, others=self._others(),
                             detail=" in shared memory")

    def _late_room(self, seq: int) -> CollectiveTimeoutError:
        slow = [r for r, c in enumerate(self._ctrl) if int(c[_CONSUMED]) < seq - 1]
        return timeout_error(rank=self.rank, what=f"collective #{seq}", timeout_s=self.timeout_s,
                             missing=slow, others=self._others(),
                             detail=" in shared memory, waiting for other ranks to read this rank's "
                                    "earlier collectives")

    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def close(self) -> None:
        self._pending.clear()
        self._ctrl = []
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:   # a view is still referenced somewhere: the mapping goes with it
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process of that number: not ours, so ours is gone
        return False
    return True


def _aligned(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def _reduce(op: str, inputs: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = the ranks' inputs combined in rank order: the same bits on every rank."""
    if op == "sum":   # an average is a sum here: comm.collectives divides once it has landed
        torch.add(inputs[0], inputs[1], out=out)
        for more in inputs[2:]:
            out.add_(more)
    elif op == "max":
        torch.maximum(inputs[0], inputs[1], out=out)
        for more in inputs[2:]:
            torch.maximum(out, more, out=out)
    elif op == "min":
        torch.minimum(inputs[0], inputs[1], out=out)
        for more in inputs[2:]:
            torch.minimum(out, more, out=out)
    else:
        raise ValueError(f"op={op!r}")
