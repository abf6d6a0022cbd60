"""verify: re-read and re-hash every chunk that committed manifests reference."""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transfer.engine.catalog import list_checkpoints, load_manifest, nothing_matches, open_catalog
from transfer.engine.chunkindex import ChunkIndex
from transfer.engine.fetch import fetch_chunks
from transfer.engine.resolver import ChunkResolver
from transfer.errors import CheckpointNotFoundError, FormatError
from transfer.options import TransferOptions
from transfer.store.base import Store


@dataclass(frozen=True)
class BadChunk:
    chunk: str
    reason: str
    used_by: tuple[str, ...]  # "job/step/node:path" of every file that needs it


@dataclass
class VerifyResult:
    checkpoints: int = 0
    chunks: int = 0  # distinct chunks read and hashed, base_chunks included
    #: of those, chunks of other steps that only this step's deltas decode against
    base_chunks: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    bad: list[BadChunk] = field(default_factory=list)
    #: parts whose manifest could not be read: "key: why" (the others are still verified)
    bad_manifests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.bad_manifests

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
        }


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
    index = ChunkIndex()
    used_by: dict[str, list[str]] = defaultdict(list)
    in_files: set[str] = set()
    for c in entries:
        try:
            m = await load_manifest(store, c.job, c.step, c.node)
        except FormatError as exc:  # one unreadable part must not hide the others' state
            result.bad_manifests.append(str(exc))
            continue
        index.add_manifest(m)
        for f in m.files:
            for ch in f.chunks:
                used_by[ch.id].append(f"{m.job}/{m.step}/{m.node}:{f.path}")
                in_files.add(ch.id)
        for ch in m.bases:
            used_by[ch.id].append(f"{m.job}/{m.step}/{m.node}:(base of a delta chunk)")
    result.chunks = len(used_by)
    result.base_chunks = len(used_by.keys() - in_files)
    bad: dict[str, str] = {}

    def count(n: int) -> None:
        result.bytes_read += n

    with ThreadPoolExecutor(options.workers, thread_name_prefix="ferry-verify") as pool:
        resolver = ChunkResolver(store, index, pool, on_bytes_read=count)
        await fetch_chunks(
            resolver,
            [chunk for cid in used_by if (chunk := index.get(cid)) is not None],
            part_size=options.part_size,
            window=options.window,
            sink=lambda c, data: None,
            on_bad=lambda c, reason: bad.__setitem__(c.id, reason),
        )
    result.bad = [
        BadChunk(cid, reason, tuple(sorted(set(used_by[cid]))))
        for cid, reason in sorted(bad.items())
    ]
    result.seconds = time.monotonic() - started
    return result
