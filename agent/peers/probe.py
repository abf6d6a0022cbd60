"""First contact with a source: fetch and decode a few of a step's chunks, the way a prefetch
would, so an estimate has a measured rate instead of a constant (issue 12: at first contact
the ETA assumed 200 MB/s, and named the tier when a peer would serve the chunks, encoding
them on its own CPU: -45% off).

A probe samples a quarter of what the prefetch would move, at least PROBE_BYTES (128 MiB: 32
chunks at the default size) and at most PROBE_MAX (``budget``). A tier probe first fetches
IN_FLIGHT single chunks at once, untimed, to open the connections and touch the buffers a
restore finds open and warm; then it times runs of chunks that lie back to back in a pack
(RUN_BYTES stored bytes of them), one request each, IN_FLIGHT at once, each read through
the store's range reader into a reused buffer, as a restore's readers stream their ranges. A
peer probe asks for each chunk as a prefetch would. Its rate stands in for the source's in
the agent's BandwidthMeter until the first transfer from there replaces it (a probe writes
nothing to disk). On the 1.69 GB corpus save (``python -m bench.estimate_cases
/work/corpus/full``, bench/results/estimate_cases.md), first-contact errors (holding nothing
/ holding k / peer / held here): +29% / +60% / +22% / -44% with 20 MiB in 4 MiB GETs;
-8..+9% / +8..+45% / +0..+42% / +5..+30% with 128 MiB in runs of 3 (its timed part, ~0.15 s,
was too short to see this machine's pace, and 12 MiB requests cost more per byte than a
restore's long ranges); -26..+14% / +2..+7% / -16..+0% / -15..+14% with this budget and runs
of 6.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from agent.peers.chunks import PEER_THREADS
from transfer.codec.transforms import Buffer
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.engine.ranges import coalesce
from transfer.engine.resolver import decode_verified, read_file_hashed
from transfer.engine.sources import ChunkSource, LocalBase, Supplied
from transfer.errors import FerryError
from transfer.format.chunkid import chunk_id
from transfer.format.layout import pack_key
from transfer.store.base import Store

PROBE_BYTES = 128 << 20
PROBE_MAX = 384 << 20
IN_FLIGHT = 8  # a tier probe's requests at once (one per connection it opens first)
#: stored bytes back to back a tier probe reads per request (six default chunks' worth): a
#: restore streams long ranges, whatever the cut. Runs of 6 chunks by count, once a DCP
#: file's small items made three chunks in four 64 KiB ones, shrank the probe's requests to
#: a fraction of a restore's and made first contact +50..+81% slow on the 1.69 GB save
RUN_BYTES = 6 * (4 << 20)
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


def budget(moving: int) -> int:
    """Raw bytes a probe samples ahead of a prefetch that moves ``moving``: a quarter of it,
    at least PROBE_BYTES, at most PROBE_MAX."""
    return min(PROBE_MAX, max(PROBE_BYTES, moving // 4))


def sample(
    index: ChunkIndex,
    needed: set[str],
    bases: dict[str, LocalBase],
    run_bytes: int = 0,
    budget: int = PROBE_BYTES,
) -> list[StoredChunk]:
    """Chunks a restore would move, up to ``budget`` raw bytes, in id order (ids are hashes: a fair
    mix of keyframes and deltas, and of sizes by count, as a peer is asked chunk by chunk),
    each followed by the chunks after it in its pack until the run holds ``run_bytes``
    stored bytes (what one request of a restore from a tier reads, however the files were
    cut; 0: each chunk alone); a delta only if this node holds its base at its position (a
    probe fetches no bases)."""
    eligible = {
        cid: c
        for cid in needed
        if (c := index.get(cid)) is not None
        and c.size
        and (c.base is None or (cid in bases and bases[cid].id == c.base))
    }
    at = {(c.pack_id, c.offset): c for c in eligible.values()}
    picked: list[StoredChunk] = []
    seen: set[str] = set()
    total = 0
    for cid in sorted(eligible):
        nxt: StoredChunk | None = eligible[cid]
        in_run = 0
        while total < budget and nxt is not None and nxt.id not in seen:
            picked.append(nxt)
            seen.add(nxt.id)
            total += nxt.size
            in_run += nxt.stored
            if in_run >= run_bytes:
                break
            nxt = at.get((nxt.pack_id, nxt.offset + nxt.stored))
    return picked


def _stored(run: list[StoredChunk]) -> int:
    return sum(c.stored for c in run)


async def probe_tier(
    store: Store, chunks: list[StoredChunk], bases: dict[str, LocalBase]
) -> Probe | None:
    """Fetch and decode ``chunks`` from the tier (deltas against this node's bytes at
    their positions) as a restore's readers do: each run of chunks back to back in a pack
    in one request (``sample(..., run_bytes=RUN_BYTES)`` picks them so), into a reused
    buffer, through the store's range reader when it has one; None if that fails (the
    estimate then keeps the meter's default).

    First up to IN_FLIGHT single chunks (a quarter of the sample at most), fetched at once,
    untimed: they open the connections and touch the buffers a restore finds open and warm
    (fresh memory costs ~1.6 ms per MiB on first touch here). The rest is timed, IN_FLIGHT
    runs at once."""
    if not chunks:
        return None
    reader = await asyncio.to_thread(store.range_reader)
    # at most a quarter of the sample warms up: a small step's few chunks are mostly timed
    n_warm = min(IN_FLIGHT, max(1, len(chunks) // 4))
    warm = [[c] for c in chunks[:n_warm]]
    # each run of chunks back to back in a pack is one request, as a restore reads it
    timed = [list(r.chunks) for r in coalesce(chunks[n_warm:], max_gap=0)] or warm
    room = max(max(c.size, c.stored) for c in chunks)
    span = max(_stored(r) for r in timed + warm)
    slots: asyncio.Queue[tuple[memoryview, memoryview]] = asyncio.Queue()
    for _ in range(min(IN_FLIGHT, len(timed) + len(warm))):
        slots.put_nowait((memoryview(bytearray(span)), memoryview(bytearray(room))))

    def finish(run: list[StoredChunk], into: memoryview, out: memoryview, got: int) -> None:
        """(In a thread.) Receive the run into ``into`` unless ``got`` says it is there,
        then decode and verify each of its chunks into ``out``."""
        first = run[0]
        if reader is not None:
            got = reader.read_into(pack_key(first.pack_id), first.offset, into[: _stored(run)])
        for c in run:
            lo = c.offset - first.offset
            base = bases[c.id].read() if c.base is not None else None
            decode_verified(c, into[lo : min(got, lo + c.stored)], base, out[: c.size])

    async def one(run: list[StoredChunk]) -> None:
        into, out = await slots.get()
        try:
            got = 0
            if reader is None:  # a store without a range reader: its async get, then copy
                first = run[0]
                end = first.offset + _stored(run)
                blob = await store.get(pack_key(first.pack_id), first.offset, end)
                into[: len(blob)] = blob
                got = len(blob)
            await asyncio.to_thread(finish, run, into, out, got)
        finally:
            slots.put_nowait((into, out))

    try:
        await asyncio.gather(*(one(r) for r in warm))
        began = time.monotonic()
        await asyncio.gather(*(one(r) for r in timed))
    except FerryError:
        return None
    took = time.monotonic() - began
    done = [c for r in timed for c in r]
    return Probe(sum(c.stored for c in done), sum(c.size for c in done), took)


@dataclass(frozen=True)
class PeersProbe:
    """What the peers served of a sample, asked as a prefetch asks: ``probe`` times the
    chunks some peer served (the asks of peers that lacked one included, as a prefetch pays
    them too); ``served`` is the fraction of the sample's raw bytes some peer served (the
    rest a prefetch fetches from the tier), ``peer`` the one that served the most."""

    probe: Probe
    served: float
    peer: str


async def probe_peers(
    peers: ChunkSource, chunks: list[StoredChunk], bases: dict[str, LocalBase]
) -> PeersProbe | None:
    """Ask the peers for ``chunks`` (as deltas against what this node holds at their
    positions) through ``peers``, the chunk source a prefetch would use (PeerSource.
    owners_first: the owner's peer first, then the others): in an N-node job the chunks a
    node lacks are spread over the others' parts, and one peer rarely holds them all
    (asking each peer for the whole sample named the tier for a prefetch the peers then
    served whole). None if no peer served any.

    First up to PEER_THREADS of them (a quarter of the sample at most), at once, untimed:
    each of the peer source's threads opens its keep-alive connection on its first ask, as
    a restore finds them open (timed, the opening made the peer's first-contact estimate
    +14..+38% slow on the 289 MB save, measured 0.66-0.72 s against 0.82-0.97 predicted)."""
    if not chunks:
        return None
    n_warm = min(PEER_THREADS, max(1, len(chunks) // 4))
    warm, timed = chunks[:n_warm], chunks[n_warm:] or chunks

    def ask(c: StoredChunk) -> Awaitable[Supplied | None]:
        # decoded into the peer source's reused buffers, verified and dropped, as a restore's
        # chunks land: decoded into fresh memory of its own, each chunk paid its pages' first
        # touch (~1.6 ms per MiB here), and was never hashed
        return peers(c, bases.get(c.id), land=_dropped)

    opened = await asyncio.gather(*(ask(c) for c in warm))
    began = time.monotonic()
    got = await asyncio.gather(*(ask(c) for c in timed))
    took = time.monotonic() - began
    answers = list(zip(timed, got, strict=True))
    if timed is not chunks:  # (a sample too small to split is asked twice, counted once)
        answers += zip(warm, opened, strict=True)
    served = [(c, g) for c, g in answers if g is not None]
    timed_served = [(c, g) for c, g in zip(timed, got, strict=True) if g is not None]
    if not timed_served:
        return None
    by_peer: dict[str, int] = {}
    for c, g in served:
        by_peer[g[2]] = by_peer.get(g[2], 0) + c.size
    moved = sum(g[1] for _, g in timed_served)
    raw = sum(c.size for c, _ in timed_served)
    fraction = sum(c.size for c, _ in served) / sum(c.size for c, _ in answers)
    peer = max(by_peer, key=lambda p: by_peer[p]).removeprefix("peer:")
    return PeersProbe(Probe(moved, raw, took), fraction, peer)


def _dropped(chunk: StoredChunk, data: Buffer) -> bool:
    """A probe's ``land``: the chunk, decoded by the peer source into a reused buffer, is
    verified as a restore verifies what it lands, then dropped."""
    return chunk_id(data) == chunk.id


def probe_local(step_dir: Path) -> Probe | None:
    """Read and hash up to PROBE_BYTES of a copy held here, chunk by chunk from the start of
    its largest file, as the re-check of a step already here does (in a thread: it reads
    the disk); None if there is nothing to read."""
    files = sorted((p for p in step_dir.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    if not files:
        return None
    # read as the re-check reads (resolver.read_file_hashed): reading one open file
    # piece by piece instead rated 780-960 MB/s a copy the re-check read at 1.9-2.1 GB/s
    # (this machine, cold page cache), and a held step's estimate came out +59..+110%
    largest = files[-1]
    want = min(PROBE_BYTES, largest.stat().st_size)
    began, done = time.monotonic(), 0
    while done < want and read_file_hashed(largest, done, min(CHUNK, want - done)) is not None:
        done += min(CHUNK, want - done)
    return Probe(done, done, time.monotonic() - began) if done else None
