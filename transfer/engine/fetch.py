"""Reading chunks back: coalesced ranged GETs of packs, decode, verify, hand to a sink.

Shared by pull (sink writes into staging files) and verify (sink does nothing). Adjacent
chunks of one pack are fetched in one ranged GET of up to ``part_size`` bytes; up to
``window`` GETs are in flight; decode + hash + sink run in worker threads.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from transfer.codec import decode
from transfer.engine.errors import first_error
from transfer.errors import FormatError, IntegrityError, NotFoundError, RangeNotSatisfiableError
from transfer.format.chunkid import chunk_id
from transfer.format.layout import pack_key
from transfer.format.manifest import Manifest
from transfer.store.base import Store

_MAX_GAP = 256 << 10  # read through gaps this small rather than issue another request


@dataclass(frozen=True, slots=True)
class ChunkSource:
    id: str
    enc: str
    size: int
    pack_id: str
    offset: int
    stored: int


def chunk_sources(manifest: Manifest) -> Iterable[ChunkSource]:
    for entry in manifest.files:
        for c in entry.chunks:
            yield ChunkSource(c.id, c.enc, c.size, manifest.packs[c.pack], c.offset, c.stored)


@dataclass(frozen=True, slots=True)
class _Range:
    pack_id: str
    start: int
    end: int
    chunks: tuple[ChunkSource, ...]


def plan_ranges(chunks: Iterable[ChunkSource], max_bytes: int) -> list[_Range]:
    """Group chunks (unique by id) into ranged reads per pack, in pack offset order."""
    by_pack: dict[str, list[ChunkSource]] = defaultdict(list)
    for c in chunks:
        by_pack[c.pack_id].append(c)
    ranges: list[_Range] = []
    for pack_id, members in by_pack.items():
        members.sort(key=lambda c: c.offset)
        group: list[ChunkSource] = []
        for c in members:
            if group:
                start, end = group[0].offset, max(g.offset + g.stored for g in group)
                if c.offset - end > _MAX_GAP or c.offset + c.stored - start > max_bytes:
                    ranges.append(_Range(pack_id, start, end, tuple(group)))
                    group = []
            group.append(c)
        if group:
            end = max(g.offset + g.stored for g in group)
            ranges.append(_Range(pack_id, group[0].offset, end, tuple(group)))
    return ranges


Sink = Callable[[ChunkSource, bytes], None]
BadChunk = Callable[[ChunkSource, str], None]


def _decode_and_check(c: ChunkSource, payload: bytes) -> bytes:
    try:
        data = decode(c.enc, payload, c.size)
    except FormatError as exc:
        raise IntegrityError(
            f"chunk {c.id} in pack {c.pack_id} is corrupt: {exc}", [c.id]
        ) from None
    if chunk_id(data) != c.id:
        raise IntegrityError(
            f"chunk {c.id} in pack {c.pack_id} is corrupt: its bytes hash to something else",
            [c.id],
        )
    return data


async def fetch_chunks(
    store: Store,
    chunks: Iterable[ChunkSource],
    *,
    pool: ThreadPoolExecutor,
    part_size: int,
    window: int,
    sink: Sink,
    on_bad: BadChunk | None = None,
    on_bytes_read: Callable[[int], None] = lambda n: None,
) -> None:
    """Fetch, decode and verify every chunk; ``sink(chunk, data)`` runs in a worker thread.

    Without ``on_bad`` the first bad chunk raises IntegrityError; with it, bad chunks are
    reported and the rest are still checked.
    """
    ranges = plan_ranges(chunks, part_size)
    queue: asyncio.Queue[_Range | None] = asyncio.Queue()
    for r in ranges:
        queue.put_nowait(r)
    loop = asyncio.get_running_loop()

    def process(r: _Range, blob: bytes) -> None:
        view = memoryview(blob)
        for c in r.chunks:
            lo = c.offset - r.start
            payload = view[lo : lo + c.stored]
            try:
                if len(payload) != c.stored:
                    raise IntegrityError(f"chunk {c.id}: pack {c.pack_id} is truncated", [c.id])
                data = _decode_and_check(c, bytes(payload))
            except IntegrityError as exc:
                if on_bad is None:
                    raise
                on_bad(c, str(exc))
                continue
            sink(c, data)

    async def worker() -> None:
        while (r := queue.get_nowait() if not queue.empty() else None) is not None:
            try:
                blob = await store.get(pack_key(r.pack_id), r.start, r.end)
            except (NotFoundError, RangeNotSatisfiableError) as exc:
                reason = (
                    f"pack {r.pack_id} is missing from the store"
                    if isinstance(exc, NotFoundError)
                    else f"pack {r.pack_id} is truncated"
                )
                if on_bad is None:
                    raise IntegrityError(
                        f"{reason} (needed by chunk {r.chunks[0].id})", [c.id for c in r.chunks]
                    ) from None
                for c in r.chunks:
                    on_bad(c, reason)
                continue
            on_bytes_read(len(blob))
            await loop.run_in_executor(pool, process, r, blob)

    try:
        async with asyncio.TaskGroup() as tasks:
            for _ in range(min(window, len(ranges))):
                tasks.create_task(worker())
    except BaseExceptionGroup as group:
        raise first_error(group) from None
