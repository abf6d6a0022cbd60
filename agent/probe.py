"""First contact with a source: fetch and decode a few of a step's chunks, the way a prefetch
would, so an estimate has a measured rate instead of a constant (issue 12: at first contact
the ETA assumed 200 MB/s, and named the tier when a peer would serve the chunks, encoding
them on its own CPU: -45% off).

A probe moves the largest chunks up to ``PROBE_BYTES`` (16 MiB: 4 chunks at the default
size), concurrently, as a restore's workers do; the rate it measures is fed to the agent's
BandwidthMeter like any transfer's, so later estimates use it until transfers refine it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from agent.peers import PeerSource
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.engine.pull import LocalBase
from transfer.engine.resolver import decode_verified
from transfer.errors import FerryError
from transfer.format.layout import pack_key
from transfer.store.base import Store

PROBE_BYTES = 16 << 20


@dataclass(frozen=True)
class Probe:
    moved: int  # bytes that crossed: stored bytes from a tier, payloads from a peer
    raw: int  # what they decoded to
    seconds: float

    @property
    def ratio(self) -> float:
        """Bytes moved per raw byte."""
        return self.moved / self.raw if self.raw else 1.0


def sample(index: ChunkIndex, needed: set[str], standalone: bool) -> list[StoredChunk]:
    """The largest chunks a restore would move (``standalone``: only those that decode
    without a base: a tier probe has no base to decode deltas against)."""
    found = [c for cid in needed if (c := index.get(cid)) is not None and c.size]
    if standalone:
        found = [c for c in found if c.base is None]
    picked, total = [], 0
    for c in sorted(found, key=lambda c: (-c.size, c.id)):
        if total >= PROBE_BYTES:
            break
        picked.append(c)
        total += c.size
    return picked


async def probe_tier(store: Store, chunks: list[StoredChunk]) -> Probe | None:
    """Fetch and decode ``chunks`` from the tier; None if it fails (the estimate then
    falls back to the meter's default)."""

    async def one(c: StoredChunk) -> None:
        payload = await store.get(pack_key(c.pack_id), c.offset, c.offset + c.stored)
        await asyncio.to_thread(decode_verified, c, payload, None)

    began = time.monotonic()
    try:
        await asyncio.gather(*(one(c) for c in chunks))
    except FerryError:
        return None
    took = time.monotonic() - began
    return Probe(sum(c.stored for c in chunks), sum(c.size for c in chunks), took)


async def probe_peer(
    peers: PeerSource,
    peer: str,
    chunks: list[StoredChunk],
    bases: dict[str, LocalBase],
) -> Probe | None:
    """Ask ``peer`` for ``chunks`` (as deltas against what this node holds at their
    positions, as a prefetch would); None unless it serves every one of them."""
    began = time.monotonic()
    got = await asyncio.gather(*(peers.ask(peer, c, bases.get(c.id)) for c in chunks))
    took = time.monotonic() - began
    if any(g is None for g in got):
        return None
    moved = sum(g[1] for g in got if g is not None)
    return Probe(moved, sum(c.size for c in chunks), took)
