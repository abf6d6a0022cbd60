"""Reading chunks back: coalesced ranged GETs of packs, decode, verify, hand to a sink.

Shared by pull (sink writes into staging files) and verify (sink does nothing). Adjacent
chunks of one pack are fetched in one ranged GET: from a reader that streams, up to
STREAM_RANGE_BYTES but short enough that each reader thread gets RANGES_PER_READER of them
(``balanced_cap``), else up to ``part_size`` bytes (at least READ_RANGE_BYTES); up to
``window`` GETs are in flight. A delta chunk's base bytes come from the resolver (a verified
local copy, or the store).

Two ways to run, by what the store offers:
- threaded (the store has a ``range_reader``: S3 and local stores): a few reader threads
  (READERS_PER_CORE) each take a whole range at a time. From a reader that streams (S3
  with static credentials: store/s3ranges.py) each chunk's payload is received into one
  chunk's room and finished before the next arrives; otherwise the range is received
  whole into a buffer reused from range to range. Either way, in the same thread, each
  chunk is decoded into a reused, page-aligned per-thread buffer (a delta chunk's base
  read from the node's copy into another), verified and sunk. One thread hop per range,
  not two per chunk, and no allocation per chunk: on 2 cores the event loop's wake-ups
  and the copies were ~20% of a pull's samples. Only chunks that need a base from the
  store (or whose local base turned out stale) go back to the loop, to the resolver
  (a streamed range sets aside at most LEFT_BYTES of them, then goes on).
- async (any other store): ``store.get`` on the loop, decode + verify + sink in the pool.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import mmap
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from transfer import directio
from transfer.codec import decode, pairs_with_keyframe
from transfer.codec.transforms import Buffer
from transfer.directio import ThreadBuffers
from transfer.engine.chunkindex import StoredChunk
from transfer.engine.ranges import ChunkRange, coalesce
from transfer.engine.ratelimit import RateLimit
from transfer.engine.resolver import ChunkResolver, Hint, read_local_into, truncated, unreadable
from transfer.engine.workers import run_workers
from transfer.errors import FormatError, IntegrityError, NotFoundError, RangeNotSatisfiableError
from transfer.format.layout import pack_key
from transfer.store.base import RangeReader, RangeStream
from transfer.store.retry import no_retries_after

_MAX_GAP = 256 << 10  # read through gaps this small rather than issue another request


def plan_ranges(chunks: Iterable[StoredChunk], max_bytes: int) -> list[ChunkRange]:
    """Group chunks (unique by id) into ranged reads per pack, in pack offset order."""
    by_pack: dict[str, list[StoredChunk]] = defaultdict(list)
    for c in chunks:
        by_pack[c.pack_id].append(c)
    for members in by_pack.values():
        members.sort(key=lambda c: c.offset)
    in_pack_order = (c for members in by_pack.values() for c in members)
    return coalesce(in_pack_order, max_gap=_MAX_GAP, max_bytes=max_bytes)


#: GETs in flight on the threaded path, per core (at most ``window``). Each reader thread
#: also writes its chunks, with O_DIRECT, so it waits for the device a third of its time
#: (py-spy): more readers than cores keep the cores busy meanwhile. Pulls of the corpus's
#: 1.69 GB saves on 2 cores, alternated, 3 rounds: 8 readers against 4, holding k 3.43
#: against 3.81 s (bf16 3.30 against 4.00 s), cold 2.95 against 3.25 s; peak RSS 166
#: against 104 MB (every buffer is per reader). Before the direct writes (buffered, all
#: CPU): 16 readers 3.53 s and 440 MB, 4 readers 3.16 s and 320 MB for a 1 GB cold pull.
READERS_PER_CORE = 4

#: The smallest cap on one ranged GET, whatever the upload part size: fewer, longer requests
#: cost the client and the server less per byte. Pull of a 1.69 GB save holding the one
#: before it from SeaweedFS (3 alternating runs each, 2 cores): 8 MiB 8.7-8.9 s and 150 MB
#: peak RSS, 16 MiB 7.6-7.9 s and 205 MB, 32 MiB 7.4-7.7 s and 330 MB.
READ_RANGE_BYTES = 16 << 20

#: The cap on one ranged GET from a reader that streams (RangeReader.stream: each chunk is
#: received into one chunk's room and finished before the next arrives, so the range's
#: length costs no memory). Longer requests cost less per byte: reading the corpus's 2.7 GB
#: of packs from 4 threads, SeaweedFS spent 4.1-5.0 CPU s in 16 MiB ranges against 3.9 s in
#: 64 MiB ones; over a link shaped to 2 Gbit/s (``python -m bench.shaped_link``) the pull of
#: k+1 holding k took 6.76 s in 16 MiB ranges, 6.56-6.61 s in 64 MiB, 6.75 s in 128 MiB and
#: 6.13-6.43 s in 256 MiB (each request starts again from a connection that sat idle while
#: its last chunk was decoded); on loopback 256 and 64 MiB were the same within noise.
STREAM_RANGE_BYTES = 256 << 20

#: What a streamed range may set aside for the loop (chunks whose base is not at hand here,
#: copied out of the reused buffer) before it stops and hands the rest of the range back:
#: a cold pull of a delta-coded save sets aside every delta chunk. Its peak RSS (full
#: fine-tune, 1.69 GB, ``python -m bench.pull_stages --scenarios cold-delta``): no cap 444
#: MB, 32 MiB 378-402 MB, 8 MiB 237-256 MB (and 5.3 s against 5.8-6.7 s).
LEFT_BYTES = 8 << 20

#: The stored bytes of keyframe bases a reader thread fetches at once for the delta chunks
#: ahead of it in a cold restore of a delta-coded step (_BaseWindow). Successive saves
#: place their chunks in nearly the same pack order, so the bases of a few consecutive
#: delta chunks lie side by side in the base step's packs: one request reads them where
#: one each did. A cold pull of the corpus's bf16 k+1 asked for 346 bases one by one, and
#: SeaweedFS spent 3.5-4.7 CPU s serving it against 2.6 s for ``s5cmd cp`` of the step.
BASE_WINDOW_BYTES = 16 << 20

#: Streamed ranges per reader thread, at least: each thread finishes the chunks of its
#: range itself (receive, decode, hash, write), so a pull of a few long ranges keeps only
#: a few threads busy. A bf16 pull of k+1 holding k (573 MB in 3 packs, 256 MiB ranges)
#: kept two of its four readers busy and the other two idle for 70-80% of the pull.
RANGES_PER_READER = 3


def balanced_cap(total: int, readers: int) -> int:
    """The cap on a streamed range for ``total`` stored bytes: long (STREAM_RANGE_BYTES at
    most), and short enough that every reader gets RANGES_PER_READER of them."""
    share = -(-total // max(1, readers * RANGES_PER_READER))
    return max(READ_RANGE_BYTES, min(STREAM_RANGE_BYTES, share))


Sink = Callable[[StoredChunk, Buffer], None]
BadChunk = Callable[[StoredChunk, str], None]


async def fetch_chunks(
    resolver: ChunkResolver,
    chunks: Iterable[StoredChunk],
    *,
    part_size: int,
    window: int,
    sink: Sink,
    hints: dict[str, Hint] | None = None,
    on_bad: BadChunk | None = None,
    rate_limit: RateLimit | None = None,
) -> None:
    """Fetch, decode and verify every chunk; ``sink(chunk, data)`` runs in a worker thread
    (``data`` may be a view of a reused buffer: consume it before returning).

    Without ``on_bad`` the first bad chunk raises IntegrityError; with it, bad chunks are
    reported and the rest are still checked.
    """
    chunks = list(chunks)
    if not chunks:
        return
    reader = await asyncio.to_thread(resolver.store.range_reader)
    streaming = reader is not None and await asyncio.to_thread(reader.streams)
    readers = min(window, READERS_PER_CORE * (os.cpu_count() or 1))
    if streaming:
        cap = balanced_cap(sum(c.stored for c in chunks), readers)
    else:
        cap = max(part_size, READ_RANGE_BYTES)
    ranges = plan_ranges(chunks, cap)
    fetch = _Fetch(resolver, sink, hints or {}, on_bad, rate_limit)
    if reader is None:
        await fetch.run_async(ranges, window)
    else:
        room = max(c.stored for c in chunks) if streaming else None
        await fetch.run_threaded(reader, ranges, min(readers, len(ranges)), room)


class _ThreadBuffers(ThreadBuffers):
    """Per reader thread: the decoded chunk ("out"), a delta chunk's base ("base") and
    that base's stored payload ("base_payload"); and the bytes this thread read for bases."""

    base_bytes = 0


class _Fetch:
    def __init__(
        self,
        resolver: ChunkResolver,
        sink: Sink,
        hints: dict[str, Hint],
        on_bad: BadChunk | None,
        rate_limit: RateLimit | None = None,
    ) -> None:
        self.resolver = resolver
        self.sink = sink
        self.hints = hints
        self.on_bad = on_bad
        self.rate_limit = rate_limit
        self.buffers = _ThreadBuffers()
        #: set when the fetch ends (done, failed or cancelled): its reader threads try no
        #: request again (store/retry.py ``no_retries_after``), so its end never waits out
        #: their retries against a store that stopped answering
        self.ending = threading.Event()

    def local_base(self, c: StoredChunk) -> memoryview | None:
        """The base of delta chunk ``c`` from the node's copy at its position (unverified:
        the chunk's own hash check covers it), or None."""
        root, hint = self.resolver.local_root, self.hints.get(c.id)
        base = self.resolver.index.get(c.base) if c.base else None
        if root is None or hint is None or base is None:
            return None
        buf = self.buffers.view("base", base.size)
        with self.resolver.clock.timing("base_read"):
            found = read_local_into(root, hint[0], hint[1], buf)
        return buf if found else None

    def remote_base(
        self, reader: RangeReader, c: StoredChunk
    ) -> tuple[StoredChunk, memoryview] | None:
        """The base of delta chunk ``c`` and its stored payload, read from the store right
        here, when it is a keyframe (a longer chain goes to the loop: None). Read on the
        side, while the range's own reply waits: a cold restore of a delta-coded step
        needs a base for most chunks, and one hop to the loop per chunk, the payloads set
        aside meanwhile, made that restore 1.7-2.1x an ``s5cmd cp`` of the step. The bases
        of the next few delta chunks come in as few requests as their places allow
        (_BaseWindow)."""
        base = self.resolver.index.get(c.base) if c.base else None
        if base is None or base.base is not None:
            return None
        window: _BaseWindow | None = getattr(self.buffers, "window", None)
        payload = window.payload(reader, base) if window is not None else None
        if payload is None:
            payload = self.buffers.view("base_payload", base.stored)
            self._read_bases(reader, [([base], payload)])
        return base, payload

    def decoded_base(self, base: StoredChunk, payload: Buffer) -> Buffer | None:
        """A keyframe base decoded on its own, unverified, as a local base is (the delta's
        own hash check covers it); None when it does not decode."""
        try:
            with self.resolver.clock.timing("decode"):
                return decode(
                    base.enc, payload, base.size, None, self.buffers.view("base", base.size)
                )
        except FormatError:
            return None  # the loop's resolver fetches it again and names what is corrupt

    def _read_bases(
        self, reader: RangeReader, reads: list[tuple[Sequence[StoredChunk], memoryview]]
    ) -> None:
        """Fill each buffer with a run of bases (sorted by offset in one pack) from the
        store: one request each; a failure names the first base it cut short."""
        for members, into in reads:
            first = members[0]
            if self.rate_limit is not None:
                self.rate_limit.take(len(into))
            try:
                with self.resolver.clock.timing("receive"):
                    got = reader.read_into(pack_key(first.pack_id), first.offset, into)
            except (NotFoundError, RangeNotSatisfiableError):
                raise unreadable(first) from None
            self.buffers.base_bytes += got
            if got != len(into):
                cut = next(b for b in members if b.offset - first.offset + b.stored > got)
                raise truncated(cut)

    def finish_in_thread(self, reader: RangeReader | None, c: StoredChunk, payload: Buffer) -> bool:
        """Decode, verify and sink one chunk in this thread; False: leave it to the loop
        (its base is neither on this node nor a keyframe, or the local base was stale)."""
        if len(payload) != c.stored:
            raise truncated(c)
        local = self.local_base(c) if c.base else None
        base: Buffer | None = local
        keyframe: tuple[str, Buffer] | None = None  # the base as stored, decoded with c
        if c.base and base is None and reader is not None:
            stored = self.remote_base(reader, c)
            if stored is not None:
                kind, size = stored[0].enc, stored[0].size
                if pairs_with_keyframe(c.enc, c.size, kind, size):
                    keyframe = (kind, stored[1])
                else:
                    base = self.decoded_base(*stored)
        if c.base and base is None and keyframe is None:
            return False
        out = self.buffers.view("out", c.size)
        try:
            data = self.resolver.decode(c, payload, base, out, keyframe)
        except IntegrityError:
            if base is None and keyframe is None:
                raise
            # the node's copy may have changed, or a base from the store is corrupt: the
            # loop's resolver reads the base again, verified, and names the bad chunk
            return False
        if local is not None:
            self.resolver.count_local_hit()
        self.sink(c, data)
        return True

    def read_and_finish(
        self, reader: RangeReader, r: ChunkRange, buf: memoryview
    ) -> tuple[int, list[tuple[StoredChunk, Buffer]], ChunkRange | None]:
        """In a reader thread: receive one range and finish what can be finished here.
        Returns (bytes received, bases included; chunks left to the loop with their
        payloads; the rest of the range when it stopped early: see LEFT_BYTES)."""
        before = self.buffers.base_bytes
        self.buffers.window = _BaseWindow(self, self._remote_bases(r.chunks))
        try:
            with no_retries_after(self.ending):
                got, left, rest = self._receive_and_finish(reader, r, buf)
        finally:
            self.buffers.window = None
        return got + self.buffers.base_bytes - before, left, rest

    def _remote_bases(self, chunks: Sequence[StoredChunk]) -> list[StoredChunk]:
        """The keyframe bases ``chunks`` will ask the store for, in the order they will
        (those the node's copy may hold are left out: it is asked first)."""
        have_local = self.resolver.local_root is not None
        bases: list[StoredChunk] = []
        for c in chunks:
            base = self.resolver.index.get(c.base) if c.base else None
            if base is not None and base.base is None and not (have_local and c.id in self.hints):
                bases.append(base)
        return bases

    def _receive_and_finish(
        self, reader: RangeReader, r: ChunkRange, buf: memoryview
    ) -> tuple[int, list[tuple[StoredChunk, Buffer]], ChunkRange | None]:
        stream = reader.stream(pack_key(r.pack_id), r.start, r.end)
        if stream is None:
            if self.rate_limit is not None:
                self.rate_limit.take(r.end - r.start)
            with self.resolver.clock.timing("receive"):
                got = reader.read_into(pack_key(r.pack_id), r.start, buf)
            view = buf[:got]
            left: list[tuple[StoredChunk, Buffer]] = []
            for c in r.chunks:
                lo = c.offset - r.start
                self._finish_or_leave(reader, c, view[lo : lo + c.stored], left, copy=False)
            return got, left, None
        with stream:
            return self._finish_streamed(reader, stream, r, buf)

    def _finish_streamed(
        self, reader: RangeReader, stream: RangeStream, r: ChunkRange, buf: memoryview
    ) -> tuple[int, list[tuple[StoredChunk, Buffer]], ChunkRange | None]:
        """Each chunk's payload received into ``buf`` (one chunk's room) as the reply
        streams past, finished before the next arrives. Payloads left to the loop are
        copied; past LEFT_BYTES of them the range stops and hands back the rest."""
        received, pos = 0, r.start
        left: list[tuple[StoredChunk, Buffer]] = []
        for i, c in enumerate(r.chunks):
            if sum(len(p) for _, p in left) >= LEFT_BYTES:  # (a handful of chunks at most)
                rest = r.chunks[i:]
                return received, left, ChunkRange(r.pack_id, rest[0].offset, r.end, rest)
            if c.offset < pos:  # overlaps the one before (a corrupt index): on its own
                self._finish_or_leave(reader, c, self._read_alone(reader, c), left, copy=False)
                continue
            while pos < c.offset:  # a small gap between chunks: read through it
                gap = buf[: min(len(buf), c.offset - pos)]
                n = self._fill(stream, gap)
                received, pos = received + n, pos + n
                if n < len(gap):
                    break
            view = buf[: c.stored]
            n = self._fill(stream, view)
            received, pos = received + n, pos + n
            self._finish_or_leave(reader, c, view[:n], left, copy=True)
        return received, left, None

    def _read_alone(self, reader: RangeReader, c: StoredChunk) -> Buffer:
        data = memoryview(bytearray(c.stored))
        return data[: reader.read_into(pack_key(c.pack_id), c.offset, data)]

    def _fill(self, stream: RangeStream, view: memoryview) -> int:
        if self.rate_limit is not None:
            self.rate_limit.take(len(view))
        with self.resolver.clock.timing("receive"):
            return stream.fill(view)

    def _finish_or_leave(
        self,
        reader: RangeReader,
        c: StoredChunk,
        payload: Buffer,
        left: list[tuple[StoredChunk, Buffer]],
        *,
        copy: bool,
    ) -> None:
        """Finish one chunk here, or add it to ``left`` for the loop (its payload copied
        when ``copy``: the buffer is about to be reused)."""
        try:
            if not self.finish_in_thread(reader, c, payload):
                left.append((c, bytes(payload) if copy else payload))
        except IntegrityError as exc:
            if self.on_bad is None:
                raise
            self.on_bad(c, str(exc))

    def finish(self, c: StoredChunk, payload: Buffer, base: Buffer | None) -> None:
        """Decode, verify, sink (in a thread)."""
        if len(payload) != c.stored:
            raise truncated(c)
        self.sink(c, self.resolver.decode(c, payload, base))

    async def one(self, c: StoredChunk, payload: Buffer) -> None:
        """Finish one chunk from the loop side, resolving its base first."""
        try:
            base = await self.resolver.raw(c.base, self.hints.get(c.id)) if c.base else None
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.resolver.pool, self.finish, c, payload, base)
        except IntegrityError as exc:
            if self.on_bad is None:
                raise
            self.on_bad(c, str(exc))

    def unreadable(self, r: ChunkRange, exc: NotFoundError | RangeNotSatisfiableError) -> None:
        what = "missing from the store" if isinstance(exc, NotFoundError) else "truncated"
        reason = f"pack {r.pack_id} is {what}"
        if self.on_bad is None:
            ids = [c.id for c in r.chunks]
            raise IntegrityError(f"{reason} (needed by chunk {ids[0]})", ids) from None
        for c in r.chunks:
            self.on_bad(c, reason)

    async def run_async(self, ranges: list[ChunkRange], window: int) -> None:
        async def worker(pending: Iterator[ChunkRange]) -> None:
            for r in pending:
                if self.rate_limit is not None:
                    await self.rate_limit.wait(r.end - r.start)
                try:
                    blob = await self.resolver.store.get(pack_key(r.pack_id), r.start, r.end)
                except (NotFoundError, RangeNotSatisfiableError) as exc:
                    self.unreadable(r, exc)
                    continue
                self.resolver.on_bytes_read(len(blob))
                view = memoryview(blob)
                for c in r.chunks:
                    lo = c.offset - r.start
                    await self.one(c, view[lo : lo + c.stored])  # no copy: decode reads the view

        await run_workers(ranges, worker, min(window, len(ranges)))

    async def run_threaded(
        self, reader: RangeReader, ranges: list[ChunkRange], readers: int, room: int | None
    ) -> None:
        """``room``: the receive buffer's size when the reader streams (one chunk's payload
        at a time), else None: each range is received whole."""
        running: set[concurrent.futures.Future[Any]] = set()
        pool = concurrent.futures.ThreadPoolExecutor(readers, thread_name_prefix="ferry-get")

        # one receive buffer per worker, sized once and reused for every range: growing it
        # range by range re-allocated (and zero-filled) 15 times per pull
        longest = room or max(r.end - r.start for r in ranges)

        async def worker(pending: Iterator[ChunkRange]) -> None:
            buf = memoryview(b"")
            for planned in pending:
                current: ChunkRange | None = planned
                while current is not None:  # a range that stopped early goes on where it stood
                    r = current
                    need = longest if room else r.end - r.start
                    if len(buf) < need:  # (a raw chunk's payload is written from it)
                        taken.append(directio.POOL.take(longest))
                        buf = memoryview(taken[-1])[:longest]
                    job = pool.submit(self.read_and_finish, reader, r, buf[:need])
                    running.add(job)
                    job.add_done_callback(running.discard)
                    try:
                        got, left, current = await asyncio.wrap_future(job)
                    except (NotFoundError, RangeNotSatisfiableError) as exc:
                        self.unreadable(r, exc)
                        break
                    self.resolver.on_bytes_read(got)
                    for c, payload in left:
                        await self.one(c, payload)  # decode reads the payload (maybe in buf)

        taken: list[mmap.mmap] = []  # receive buffers, handed back when all went well
        try:
            await run_workers(ranges, worker, readers)
        finally:
            self.ending.set()
            pool.shutdown(wait=False, cancel_futures=True)
            await _drain(running)
        # (only now: after a failure or a cancel a decode may still be reading one)
        for buf in taken:
            directio.POOL.give(buf)


class _BaseWindow:
    """The stored payloads of the keyframe bases one range's delta chunks need, fetched a
    window at a time: the next bases in the order the chunks ask for them, up to
    BASE_WINDOW_BYTES, sorted by place and read in as few requests as adjacent places
    allow, into one reused buffer of the reader's. Unlike a range, a run never reads
    through a gap: the bytes moved stay the bytes the restore needs."""

    def __init__(self, fetch: _Fetch, bases: list[StoredChunk]) -> None:
        self.fetch = fetch
        self.todo = collections.deque(bases)
        self.held: dict[str, memoryview] = {}

    def payload(self, reader: RangeReader, base: StoredChunk) -> memoryview | None:
        """``base``'s stored bytes, or None when it was not planned (read it alone)."""
        if base.id not in self.held:
            if not any(b.id == base.id for b in self.todo):
                return None
            self._load(reader, base)
        return self.held.pop(base.id, None)

    def _load(self, reader: RangeReader, first: StoredChunk) -> None:
        """Read the window that starts with ``first`` (bases before it were not asked
        for: they are dropped)."""
        while self.todo and self.todo[0].id != first.id:
            self.todo.popleft()
        window: dict[str, StoredChunk] = {}
        size = 0
        while self.todo and (not window or size + self.todo[0].stored <= BASE_WINDOW_BYTES):
            b = self.todo.popleft()
            if b.id not in window:
                window[b.id] = b
                size += b.stored
        in_place_order = sorted(window.values(), key=lambda b: (b.pack_id, b.offset))
        runs = coalesce(in_place_order, max_gap=0)  # adjacent bases only: no gap read through
        room = self.fetch.buffers.view("base_window", sum(r.end - r.start for r in runs))
        reads: list[tuple[Sequence[StoredChunk], memoryview]] = []
        self.held.clear()  # the buffer is reused: nothing earlier stays valid
        pos = 0
        for r in runs:
            into = room[pos : pos + r.end - r.start]
            reads.append((r.chunks, into))
            for b in r.chunks:
                self.held[b.id] = into[b.offset - r.start : b.offset - r.start + b.stored]
            pos += r.end - r.start
        self.fetch._read_bases(reader, reads)


async def _drain(jobs: set[concurrent.futures.Future[Any]]) -> None:
    """Wait, without blocking the loop, until no reader thread runs: a sink must never be
    called after fetch_chunks returns (the caller closes its files then). Even when we are
    cancelled meanwhile: the cancellation is re-raised once they are done."""
    waiting = [j for j in jobs if not j.done()]
    if not waiting:
        return
    done = asyncio.ensure_future(asyncio.to_thread(concurrent.futures.wait, waiting))
    cancelled = False
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
