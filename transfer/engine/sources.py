"""Where a pull finds a chunk before it goes to the store: the chunk-source protocol.

A pull takes each chunk from the cheapest place that has it: in place (a killed pull's
staging dir, always looked at), the node's earlier checkpoint (``Sources.base_dir``), each
source of ``Sources.chain`` in order, and the store last. The engine knows a source only
by this protocol; who answers behind it (an agent's peers, a fan-out's members) is the
caller's business, so nothing here is shaped by one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from transfer.codec.transforms import Buffer
from transfer.engine.chunkindex import StoredChunk
from transfer.format.manifest import Manifest

#: where a chunk lies in a local copy: (file, offset, size)
Location = tuple[Path, int, int]


@dataclass(frozen=True)
class LocalBase:
    """What this node holds at a chunk's position in ``base_dir`` (the previous step's
    chunk, usually): a chunk source may send the chunk as a delta against it. ``read``
    gets its bytes (unverified: the decoded chunk's own hash check covers them), only when
    a delta actually came: a source that sends the chunk whole costs no local read."""

    id: str
    read: Callable[[], Buffer | None]


#: what a chunk source returns: the chunk's bytes (unverified; None when it handed them to
#: the caller's ``land`` itself), the bytes it moved, and where they came from (e.g.
#: ``peer:http://10.0.0.8:7070``)
Supplied = tuple[Buffer | None, int, str]
#: checks a chunk's bytes and writes them (in the caller's worker thread); False: wrong bytes
Land = Callable[[StoredChunk, Buffer], bool]


class ChunkSource(Protocol):
    """Asked for a chunk (and told what base this node holds for it, if any): its bytes,
    or None. With ``land``, a source may hand the bytes to it in the thread that received
    them, from a buffer it reuses (one hop and no copy per chunk), and return None as the
    bytes; a chunk land refused is not supplied."""

    async def __call__(
        self, chunk: StoredChunk, base: LocalBase | None, land: Land | None = None
    ) -> Supplied | None: ...


@dataclass(frozen=True)
class Sources:
    """A pull's sources before the store, cheapest first. ``base_dir``: a local checkpoint
    of the job (e.g. the previous step) whose chunks are reused, after hash verification,
    instead of being downloaded, and which supplies delta chunks' bases (read as a batch
    of same-position reads, beside the downloads). ``base_manifests``: base_dir's
    committed manifests, when known: then only the chunks they place at the same position
    are looked for there (without them the pull looks them up by base_dir's name).
    ``chain``: asked in order for every chunk neither base_dir nor a repeat supplies; what
    one returns is used only when it hashes to the chunk id. ``store_first(id)``: chunks
    no source of the chain will have (in a fan-out, those this member reads for the
    others): fetched from the store at once, beside the chain, rather than after it; a
    chunk the chain did not supply that ``store_first`` then says is this member's is
    fetched at once too, not after the chain's other asks (which may wait on members
    waiting for it). ``ask_first(id)``: chunks the chain answers without waiting (in a
    fan-out, those another member holds), asked before the others."""

    base_dir: Path | None = None
    base_manifests: list[Manifest] | None = None
    chain: tuple[ChunkSource, ...] = ()
    store_first: Callable[[str], bool] | None = None
    ask_first: Callable[[str], bool] | None = None

    async def ask(
        self, chunk: StoredChunk, base: LocalBase | None, land: Land | None = None
    ) -> Supplied | None:
        """The first answer of the chain's sources, in order (itself a ChunkSource)."""
        for source in self.chain:
            got = await source(chunk, base, land)
            if got is not None:
                return got
        return None
