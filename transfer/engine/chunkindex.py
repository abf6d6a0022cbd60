"""Which chunks a store already holds, and where: built from committed manifests.

Only manifests are trusted as an index: a pack without a manifest may be a crashed push's
leftover that GC is about to delete, so nothing deduplicates against it.
"""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass

from transfer.engine.catalog import list_checkpoints, load_manifest
from transfer.errors import FormatError
from transfer.format.manifest import ChunkRef, Manifest
from transfer.store.base import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredChunk:
    id: str
    enc: str
    pack_id: str
    offset: int
    stored: int


class ChunkIndex:
    def __init__(self) -> None:
        self._chunks: dict[str, StoredChunk] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def get(self, cid: str) -> StoredChunk | None:
        return self._chunks.get(cid)

    def add_manifest(self, manifest: Manifest) -> None:
        for entry in manifest.files:
            for c in entry.chunks:
                self._chunks.setdefault(
                    c.id, StoredChunk(c.id, c.enc, manifest.packs[c.pack], c.offset, c.stored)
                )

    @classmethod
    async def load(cls, store: Store, job: str, newest_steps: int) -> ChunkIndex:
        index = cls()
        entries = await list_checkpoints(store, job)
        steps = sorted({c.step for c in entries})[-newest_steps:] if newest_steps > 0 else []
        for c in entries:
            if c.step in steps:
                try:
                    manifest = await load_manifest(store, c.job, c.step, c.node)
                except FormatError as exc:
                    # dedupe is an optimisation: an unreadable manifest only costs bytes
                    log.warning("not deduplicating against %s/%s/%s: %s", *astuple(c)[:3], exc)
                    continue
                index.add_manifest(manifest)
        return index


def build_refs(
    chunks: list[list[tuple[StoredChunk, int]]],
) -> tuple[tuple[str, ...], list[tuple[ChunkRef, ...]]]:
    """Manifest form of per-file chunk lists: (pack ids, per-file ChunkRefs indexing them)."""
    pack_index: dict[str, int] = {}
    files = []
    for file_chunks in chunks:
        refs = []
        for stored, size in file_chunks:
            idx = pack_index.setdefault(stored.pack_id, len(pack_index))
            refs.append(ChunkRef(stored.id, size, stored.enc, idx, stored.offset, stored.stored))
        files.append(tuple(refs))
    return tuple(pack_index), files
