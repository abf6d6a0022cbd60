"""verify: re-read and re-hash every stored chunk that committed manifests reference.

Every stored copy, not every chunk id: the same content may be stored in several packs
(pushed under another job, or by another node, outside each other's dedupe window), and a
restore reads the copy its own manifest names, so a corrupt second copy is as bad as a
corrupt only one (it was reported "all good" when the first copy was sound)."""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transfer.engine.catalog import (
    Catalog,
    list_checkpoints,
    load_manifest,
    nothing_matches,
    open_catalog,
)
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.engine.fetch import fetch_chunks
from transfer.engine.resolver import ChunkResolver
from transfer.errors import CheckpointNotFoundError, FormatError
from transfer.format import layout
from transfer.format.manifest import ChunkRef, Manifest
from transfer.format.stepcommon import made_from
from transfer.options import TransferOptions
from transfer.store.base import Store


@dataclass(frozen=True)
class BadChunk:
    chunk: str
    reason: str
    used_by: tuple[str, ...]  # "job/step/node:path" of every file that needs it
    #: which stored copy (the same chunk may be stored in several packs)
    pack: str = ""
    offset: int = 0


@dataclass
class VerifyResult:
    checkpoints: int = 0
    chunks: int = 0  # distinct stored chunks read and hashed, base_chunks included
    #: of those, chunks of other steps that only this step's deltas decode against
    base_chunks: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    bad: list[BadChunk] = field(default_factory=list)
    #: parts whose manifest could not be read: "key: why" (the others are still verified)
    bad_manifests: list[str] = field(default_factory=list)
    #: completion markers whose common index vouches for parts it does not describe
    bad_indexes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.bad_manifests and not self.bad_indexes

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "checkpoints": self.checkpoints,
            "chunks": self.chunks,
            "base_chunks": self.base_chunks,
            "bytes_transferred": self.bytes_read,
            "seconds": self.seconds,
            "bad_chunks": [b.__dict__ for b in self.bad],
            "bad_manifests": list(self.bad_manifests),
            "bad_indexes": list(self.bad_indexes),
        }


Extent = tuple[str, int]  # (pack, offset): one stored copy of a chunk


async def _index_problems(catalog: Catalog, parts: list[Manifest]) -> list[str]:
    """Where the step's completion marker's common index says a chunk is at a place of a
    file where the part holding the file has another (format/stepcommon.py). An index made
    from other parts than these (stale) is no problem: readers do not use it. One that
    vouches for these parts and disagrees with them would restore the wrong items."""
    job, step = parts[0].job, parts[0].step
    files = await catalog.step_files(job, step)
    if files is None or files.common is None or not made_from(files.common, parts):
        return []
    owners = {m.node: m for m in parts}
    wrong = []  # (path, offset, the index's chunk, the part's, its node), a file each
    for entry in files.common.files:
        node = files.files[entry.path][0]
        part = owners.get(node)
        held = next((f for f in part.files if f.path == entry.path), None) if part else None
        at = {} if held is None else {start: c.id for start, c in held.chunk_offsets()}
        for start, c in entry.chunk_offsets():
            if at.get(start) != c.id:
                wrong.append((entry.path, start, c.id, at.get(start), node))
                break
    if not wrong:
        return []
    path, start, theirs, ours, node = wrong[0]
    more = f" (and in {len(wrong) - 1} more file(s))" if len(wrong) > 1 else ""
    return [
        f"{layout.completion_key(job, step)}: its common index puts chunk {theirs} at {path} "
        f"offset {start}, where {node}'s part has {ours or 'no chunk starting'}{more}"
    ]


def _extent(
    stored: dict[Extent, StoredChunk], m: Manifest, ch: ChunkRef, added: list[Extent]
) -> Extent:
    """The stored copy ``ch`` of ``m`` names, recorded in ``stored`` (and in ``added`` if
    no manifest before named it)."""
    at = (m.packs[ch.pack], ch.offset)
    if at not in stored:
        stored[at] = StoredChunk(ch.id, ch.size, ch.enc, at[0], ch.offset, ch.stored, ch.base)
        added.append(at)
    return at


async def verify(
    store: Store,
    *,
    job: str | None = None,
    step: int | None = None,
    options: TransferOptions | None = None,
) -> VerifyResult:
    options = options or TransferOptions()
    started = time.monotonic()
    if not await open_catalog(store, create=False):
        raise CheckpointNotFoundError(f"{store.url} holds no checkpoints")
    entries = [c for c in await list_checkpoints(store, job) if step is None or c.step == step]
    if not entries:
        raise await nothing_matches(store, job, step)
    result = VerifyResult(checkpoints=len(entries))
    stored: dict[Extent, StoredChunk] = {}
    used_by: dict[Extent, list[str]] = defaultdict(list)
    in_files: set[Extent] = set()
    # each copy is read with the first manifest that names it, and a delta decoded against
    # the base copy that manifest names (as a pull of it would): a bad base copy of another
    # job must not make this one's sound copies look bad
    by_manifest: list[tuple[ChunkIndex, list[Extent]]] = []
    by_step: dict[tuple[str, int], list[Manifest]] = defaultdict(list)
    unreadable: set[tuple[str, int]] = set()
    for c in entries:
        try:
            m = await load_manifest(store, c.job, c.step, c.node)
        except FormatError as exc:  # one unreadable part must not hide the others' state
            result.bad_manifests.append(str(exc))
            unreadable.add((c.job, c.step))
            continue
        by_step[(m.job, m.step)].append(m)
        index = ChunkIndex()
        index.add_manifest(m)
        added: list[Extent] = []
        for f in m.files:
            for ch in f.chunks:
                at = _extent(stored, m, ch, added)
                used_by[at].append(f"{m.job}/{m.step}/{m.node}:{f.path}")
                in_files.add(at)
        for ch in m.bases:
            at = _extent(stored, m, ch, added)
            used_by[at].append(f"{m.job}/{m.step}/{m.node}:(base of a delta chunk)")
        if added:
            by_manifest.append((index, added))
    result.chunks = len(used_by)
    result.base_chunks = len(used_by.keys() - in_files)
    catalog = Catalog(store)
    for (job_, step_), parts in sorted(by_step.items()):
        if (job_, step_) not in unreadable:
            result.bad_indexes += await _index_problems(catalog, parts)
    bad: dict[Extent, str] = {}

    def count(n: int) -> None:
        result.bytes_read += n

    with ThreadPoolExecutor(options.workers, thread_name_prefix="ferry-verify") as pool:
        for index, extents in by_manifest:
            await fetch_chunks(
                ChunkResolver(store, index, pool, on_bytes_read=count),
                [stored[at] for at in extents],
                part_size=options.part_size,
                window=options.window,
                sink=lambda c, data: None,
                on_bad=lambda c, reason: bad.__setitem__((c.pack_id, c.offset), reason),
            )
    result.bad = [
        BadChunk(stored[at].id, reason, tuple(sorted(set(used_by[at]))), pack=at[0], offset=at[1])
        for at, reason in sorted(bad.items(), key=lambda item: (stored[item[0]].id, item[0]))
    ]
    result.seconds = time.monotonic() - started
    return result
