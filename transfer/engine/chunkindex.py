"""Which chunks a store already holds, where, and what each delta chunk needs: built from
committed manifests.

Only manifests are trusted as an index: a pack without a manifest may be a crashed push's
leftover that GC is about to delete, so nothing deduplicates against it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from transfer.engine.catalog import Catalog
from transfer.errors import FormatError, NotFoundError
from transfer.format.manifest import ChunkRef, Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredChunk:
    id: str
    size: int
    enc: str
    pack_id: str
    offset: int
    stored: int
    base: str | None = None


class ChunkIndex:
    def __init__(self) -> None:
        self._chunks: dict[str, StoredChunk] = {}
        self._depth: dict[str, int] = {}
        self._cold: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, cid: str) -> StoredChunk | None:
        return self._chunks.get(cid)

    def __getitem__(self, cid: str) -> StoredChunk:
        """A chunk the caller knows is indexed (a manifest named it): KeyError otherwise."""
        return self._chunks[cid]

    def add(self, chunk: StoredChunk) -> None:
        self._chunks.setdefault(chunk.id, chunk)

    def add_manifest(self, manifest: Manifest) -> None:
        for c in manifest.all_chunks():
            self.add(
                StoredChunk(c.id, c.size, c.enc, manifest.packs[c.pack], c.offset, c.stored, c.base)
            )

    def depth(self, cid: str) -> int:
        """Decode steps to restore ``cid`` (0: not a delta). Manifests are validated to have
        complete, acyclic chains, so every base is known here."""
        if cid in self._depth:
            return self._depth[cid]
        chain, cur = [], self._chunks.get(cid)
        while cur is not None and cur.base is not None and cur.id not in self._depth:
            chain.append(cur.id)
            cur = self._chunks.get(cur.base)
        base_depth = 0 if cur is None or cur.base is None else self._depth.get(cur.id, 0)
        for i, link in enumerate(reversed(chain)):
            self._depth[link] = base_depth + 1 + i
        return self._depth.get(cid, 0)

    def cold_cost(self, cid: str) -> int:
        """Stored bytes a restore of ``cid`` must fetch when the node holds none of its
        chain: its own payload and every base's, back to the keyframe."""
        if cid in self._cold:
            return self._cold[cid]
        chain, cur = [], self._chunks.get(cid)
        while cur is not None and cur.id not in self._cold:
            chain.append(cur)
            cur = self._chunks.get(cur.base) if cur.base else None
        below = 0 if cur is None else self._cold[cur.id]
        for link in reversed(chain):
            below += link.stored
            self._cold[link.id] = below
        return self._cold.get(cid, 0)

    def closure(self, ids: Iterable[str]) -> list[StoredChunk]:
        """The base chunks that the given chunks need, transitively, in no particular order."""
        seen: set[str] = set()
        out: list[StoredChunk] = []
        for cid in ids:
            cur = self._chunks.get(cid)
            while cur is not None and cur.base is not None and cur.base not in seen:
                seen.add(cur.base)
                base = self._chunks[cur.base]
                out.append(base)
                cur = base
        return out

    @classmethod
    async def load(cls, catalog: Catalog, job: str, node: str, newest_steps: int) -> ChunkIndex:
        """The chunks of ``node``'s own newest ``newest_steps`` parts: what a push of that
        node deduplicates against. Its own parts, not the job's: each node holds its own
        ranks' shards, so other nodes' parts rarely share a chunk with it, and reading
        them made every push of an N-node job read N x steps manifests."""
        index = cls()
        steps = (await catalog.node_steps(job, node))[-newest_steps:] if newest_steps > 0 else []
        for step in steps:  # oldest first: the first loaded wins (FORMAT.md)
            try:
                manifest = await catalog.manifest(job, step, node)
            except NotFoundError:
                continue  # deleted since the node's head named it
            except FormatError as exc:
                # dedupe is an optimisation: an unreadable manifest only costs bytes
                log.warning("not deduplicating against %s/%s/%s: %s", job, step, node, exc)
                continue
            index.add_manifest(manifest)
        return index


def build_refs(
    files: list[list[StoredChunk]], bases: list[StoredChunk]
) -> tuple[tuple[str, ...], list[tuple[ChunkRef, ...]], tuple[ChunkRef, ...]]:
    """Manifest form: (pack ids, per-file ChunkRefs, base ChunkRefs), all indexing one
    pack list."""
    pack_index: dict[str, int] = {}

    def ref(s: StoredChunk) -> ChunkRef:
        idx = pack_index.setdefault(s.pack_id, len(pack_index))
        return ChunkRef(s.id, s.size, s.enc, idx, s.offset, s.stored, s.base)

    file_refs = [tuple(ref(s) for s in chunks) for chunks in files]
    base_refs = tuple(ref(s) for s in bases)
    return tuple(pack_index), file_refs, base_refs
