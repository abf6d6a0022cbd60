"""Reading chunks back: coalesced ranged GETs of packs, decode, verify, hand to a sink.

Shared by pull (sink writes into staging files) and verify (sink does nothing). Adjacent
chunks of one pack are fetched in one ranged GET of up to ``part_size`` bytes; up to
``window`` GETs are in flight; decode + hash + sink run in worker threads. A delta chunk's
base bytes come from the resolver (a verified local copy, or the store).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from transfer.codec.transforms import Buffer
from transfer.engine.chunkindex import StoredChunk
from transfer.engine.errors import first_error
from transfer.engine.resolver import ChunkResolver, Hint
from transfer.errors import IntegrityError, NotFoundError, RangeNotSatisfiableError
from transfer.format.layout import pack_key

_MAX_GAP = 256 << 10  # read through gaps this small rather than issue another request


@dataclass(frozen=True, slots=True)
class _Range:
    pack_id: str
    start: int
    end: int
    chunks: tuple[StoredChunk, ...]


def plan_ranges(chunks: Iterable[StoredChunk], max_bytes: int) -> list[_Range]:
    """Group chunks (unique by id) into ranged reads per pack, in pack offset order."""
    by_pack: dict[str, list[StoredChunk]] = defaultdict(list)
    for c in chunks:
        by_pack[c.pack_id].append(c)
    ranges: list[_Range] = []
    for pack_id, members in by_pack.items():
        members.sort(key=lambda c: c.offset)
        group: list[StoredChunk] = []
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
) -> None:
    """Fetch, decode and verify every chunk; ``sink(chunk, data)`` runs in a worker thread.

    Without ``on_bad`` the first bad chunk raises IntegrityError; with it, bad chunks are
    reported and the rest are still checked.
    """
    store, pool = resolver.store, resolver.pool
    ranges = plan_ranges(chunks, part_size)
    pending = iter(ranges)
    loop = asyncio.get_running_loop()
    hints = hints or {}

    def finish(c: StoredChunk, payload: Buffer, base: Buffer | None) -> None:
        if len(payload) != c.stored:
            raise IntegrityError(f"chunk {c.id}: pack {c.pack_id} is truncated", [c.id])
        sink(c, resolver.decode(c, payload, base))

    async def one(c: StoredChunk, payload: Buffer) -> None:
        try:
            base = await resolver.raw(c.base, hints.get(c.id)) if c.base else None
            await loop.run_in_executor(pool, finish, c, payload, base)
        except IntegrityError as exc:
            if on_bad is None:
                raise
            on_bad(c, str(exc))

    async def worker() -> None:
        for r in pending:  # a shared iterator: each range goes to exactly one worker
            try:
                blob = await store.get(pack_key(r.pack_id), r.start, r.end)
            except (NotFoundError, RangeNotSatisfiableError) as exc:
                what = "missing from the store" if isinstance(exc, NotFoundError) else "truncated"
                reason = f"pack {r.pack_id} is {what}"
                if on_bad is None:
                    ids = [c.id for c in r.chunks]
                    raise IntegrityError(f"{reason} (needed by chunk {ids[0]})", ids) from None
                for c in r.chunks:
                    on_bad(c, reason)
                continue
            resolver.on_bytes_read(len(blob))
            view = memoryview(blob)
            for c in r.chunks:
                lo = c.offset - r.start
                await one(c, view[lo : lo + c.stored])  # no copy: decode reads the view

    try:
        async with asyncio.TaskGroup() as tasks:
            for _ in range(min(window, len(ranges))):
                tasks.create_task(worker())
    except BaseExceptionGroup as group:
        raise first_error(group) from None
