"""First contact with a source: fetch and decode a few of a step's chunks, the way a prefetch
would, so an estimate has a measured rate instead of a constant (issue 12: at first contact
the ETA assumed 200 MB/s, and named the tier when a peer would serve the chunks, encoding
them on its own CPU: -45% off).

A probe moves chunks up to ``PROBE_BYTES`` (96 MiB: 24 chunks at the default size). A tier
probe fetches the first IN_FLIGHT at once, untimed, to open the connections and touch the
buffers a restore finds open and warm, then times the rest, IN_FLIGHT at once, each read
through the store's range reader into a reused buffer, as a restore's readers do. Its rate
stands in for the source's in the agent's BandwidthMeter until the first transfer from
there replaces it (a probe writes nothing to disk). On the 1.69 GB corpus save (``python -m
bench.estimate_cases /work/corpus/full``) first-contact errors went from +29% / +60% / +22%
/ -44% (holding nothing / holding k / peer / held here; 20 MiB, one connection warmed,
fresh buffers) to +7% / +43..+54% / -5..-8% / +4..+13%: a restore of a step held at k
decodes its deltas faster per byte than a short burst of them does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from agent.peers import PeerSource
from transfer.codec.transforms import Buffer
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.engine.pull import LocalBase
from transfer.engine.resolver import decode_verified
from transfer.errors import FerryError
from transfer.format.chunkid import chunk_id
from transfer.format.layout import pack_key
from transfer.store.base import Store

PROBE_BYTES = 96 << 20
IN_FLIGHT = 8  # a tier probe's chunks at once (one per connection it opens first)
CHUNK = 4 << 20  # what a local re-check reads and hashes at a time


@dataclass(frozen=True)
class Probe:
    moved: int  # bytes that crossed: stored bytes from a tier, payloads from a peer
    raw: int  # what they decoded to
    seconds: float

    @property
    def ratio(self) -> float:
        """Bytes moved per raw byte."""
        return self.moved / self.raw if self.raw else 1.0


def sample(index: ChunkIndex, needed: set[str], bases: dict[str, LocalBase]) -> list[StoredChunk]:
    """Chunks a restore would move, up to PROBE_BYTES, in id order (ids are hashes: a fair
    mix of keyframes and deltas); a delta only if this node holds its base at its position
    (a probe fetches no bases)."""
    found = [
        c
        for cid in sorted(needed)
        if (c := index.get(cid)) is not None
        and c.size
        and (c.base is None or (cid in bases and bases[cid].id == c.base))
    ]
    picked, total = [], 0
    for c in found:
        if total >= PROBE_BYTES:
            break
        picked.append(c)
        total += c.size
    return picked


async def probe_tier(
    store: Store, chunks: list[StoredChunk], bases: dict[str, LocalBase]
) -> Probe | None:
    """Fetch and decode ``chunks`` from the tier (deltas against this node's bytes at
    their positions) as a restore's readers do: each into a reused buffer, through the
    store's range reader when it has one; None if that fails (the estimate then keeps the
    meter's default).

    The first IN_FLIGHT chunks, fetched at once, are untimed: they open the connections
    and touch the buffers a restore finds open and warm (fresh memory costs ~1.6 ms per
    MiB on first touch here). The rest is timed, IN_FLIGHT at once."""
    if not chunks:
        return None
    reader = await asyncio.to_thread(store.range_reader)
    room = max(max(c.size, c.stored) for c in chunks)
    slots: asyncio.Queue[tuple[memoryview, memoryview]] = asyncio.Queue()
    for _ in range(min(IN_FLIGHT, len(chunks))):
        slots.put_nowait((memoryview(bytearray(room)), memoryview(bytearray(room))))

    def receive_and_decode(
        c: StoredChunk, payload: Buffer, into: memoryview, out: memoryview
    ) -> None:
        if reader is not None:
            got = reader.read_into(pack_key(c.pack_id), c.offset, into[: c.stored])
            payload = into[:got]
        base = bases[c.id].read() if c.base is not None else None
        decode_verified(c, payload, base, out[: c.size])

    async def one(c: StoredChunk) -> None:
        into, out = await slots.get()
        try:
            payload: Buffer = b""
            if reader is None:
                payload = await store.get(pack_key(c.pack_id), c.offset, c.offset + c.stored)
            await asyncio.to_thread(receive_and_decode, c, payload, into, out)
        finally:
            slots.put_nowait((into, out))

    warm, timed = chunks[:IN_FLIGHT], chunks[IN_FLIGHT:] or chunks
    try:
        await asyncio.gather(*(one(c) for c in warm))
        began = time.monotonic()
        await asyncio.gather(*(one(c) for c in timed))
    except FerryError:
        return None
    took = time.monotonic() - began
    return Probe(sum(c.stored for c in timed), sum(c.size for c in timed), took)


async def probe_peer(
    peers: PeerSource,
    peer: str,
    chunks: list[StoredChunk],
    bases: dict[str, LocalBase],
) -> Probe | None:
    """Ask ``peer`` for ``chunks`` (as deltas against what this node holds at their
    positions, as a prefetch would); None unless it serves every one of them."""
    if not chunks or await peers.ask(peer, chunks[0], bases.get(chunks[0].id)) is None:
        return None  # (untimed: it also opens the connection a restore would find open)
    timed = chunks[1:] or chunks
    began = time.monotonic()
    got = await asyncio.gather(*(peers.ask(peer, c, bases.get(c.id)) for c in timed))
    took = time.monotonic() - began
    if any(g is None for g in got):
        return None
    moved = sum(g[1] for g in got if g is not None)
    return Probe(moved, sum(c.size for c in timed), took)


def probe_local(step_dir: Path) -> Probe | None:
    """Read and hash up to PROBE_BYTES of a copy held here, chunk by chunk from the start of
    its largest file, as the re-check of a step already here does (in a thread: it reads
    the disk); None if there is nothing to read."""
    files = sorted((p for p in step_dir.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    if not files:
        return None
    began, done = time.monotonic(), 0
    with open(files[-1], "rb", buffering=0) as fh:
        while done < PROBE_BYTES and (piece := fh.read(min(CHUNK, PROBE_BYTES - done))):
            chunk_id(piece)
            done += len(piece)
    return Probe(done, done, time.monotonic() - began) if done else None
