"""Restore byte ranges of a step straight into the caller's memory: no staging files, no disk.

For a loader that consumes bytes as they land (dcpreader_torch.py: a DCP StorageReader that
deserialises each item the moment its bytes are in), so the fetch and the load overlap and
nothing is written to the node's disk and read back. The sources and checks are a pull's
(pull.py): a chunk that the node's earlier checkpoint (``base_dir``) holds unchanged at the
same position is read there, a delta chunk decodes against that copy's base, the rest come
from the store; every chunk is verified against its id before the caller sees it.

The caller gets ``landed(path, offset, data)`` once per position of every chunk that
overlaps a wanted range, from worker threads (``data`` may be a view of a reused buffer:
copy what you need before returning). All-zero chunks are not fetched; they are handed
on as zeros like the rest, so a caller may count bytes to know when a range is complete.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from transfer.codec.transforms import Buffer
from transfer.engine.chunkindex import StoredChunk
from transfer.engine.dcpshare import overlaps
from transfer.engine.fetch import fetch_chunks
from transfer.engine.pull import (
    checked_index,
    held_at,
    manifests_named_by,
    reuse_local,
    same_position,
    zero_chunk_id,
)
from transfer.engine.pullplan import merged_files
from transfer.engine.resolver import ChunkResolver
from transfer.engine.scan import check_base_dir
from transfer.engine.taskgroup_errors import first_error
from transfer.errors import FerryError
from transfer.format.manifest import Manifest
from transfer.options import TransferOptions
from transfer.store.base import Store

#: path -> sorted, disjoint [lo, hi) byte ranges wanted of that file
Wanted = Mapping[str, Sequence[tuple[int, int]]]
#: (file path, offset in the file, the verified chunk's bytes), called in a worker thread
Landed = Callable[[str, int, Buffer], None]


@dataclass
class MemRestoreResult:
    bytes_raw: int  # file bytes of the chunks handed on (each position counted)
    bytes_fetched: int  # stored bytes read from the store
    chunks_fetched: int
    chunks_local: int  # read unchanged from base_dir
    seconds: float


@dataclass
class _Plan:
    targets: dict[str, list[tuple[str, int]]]  # chunk id -> [(path, offset)] to hand it to
    zeros: list[tuple[str, int, int]]  # (path, offset, size) of all-zero chunks
    bytes_raw: int


def _plan(manifests: list[Manifest], wanted: Wanted) -> _Plan:
    """The chunks that cover ``wanted``, where each goes; a path the step lacks is an error
    (the caller asked for a file the save does not have)."""
    files = {f.path: f for f in merged_files(manifests)}
    missing = sorted(set(wanted) - set(files))
    if missing:
        m = manifests[0]
        raise FerryError(f"{m.job} step {m.step} has no file {missing[0]!r}")
    targets: dict[str, list[tuple[str, int]]] = defaultdict(list)
    zeros: list[tuple[str, int, int]] = []
    bytes_raw = 0
    for path, spans in wanted.items():
        f, spans = files[path], tuple(spans)
        if spans and spans[-1][1] > f.size:
            raise FerryError(f"{path!r} is {f.size} bytes: a range ends at {spans[-1][1]}")
        for offset, c in f.chunk_offsets():
            if not overlaps(spans, offset, offset + c.size):
                continue
            bytes_raw += c.size
            if c.id == zero_chunk_id(c.size):
                zeros.append((path, offset, c.size))
            else:
                targets[c.id].append((path, offset))
    return _Plan(dict(targets), zeros, bytes_raw)


async def restore_ranges(
    store: Store,
    manifests: list[Manifest],
    wanted: Wanted,
    landed: Landed,
    base_dir: Path | None = None,
    options: TransferOptions | None = None,
) -> MemRestoreResult:
    """Hand every chunk covering ``wanted`` of the step ``manifests`` make (every part of
    it: catalog.resolve_manifests) to ``landed``, verified; ``base_dir``: the node's copy
    of an earlier step of the job (``step_000040``), read for unchanged chunks and bases."""
    options = options or TransferOptions()
    started = time.monotonic()
    check_base_dir(base_dir)
    plan = _plan(manifests, wanted)
    index = checked_index(manifests)
    hints = {cid: positions[0] for cid, positions in plan.targets.items()}
    base_manifests = None
    if base_dir is not None:
        base_manifests = await manifests_named_by(store, manifests[0].job, base_dir)
    held = held_at(base_manifests) if base_dir is not None else {}
    candidates = same_position(plan.targets, hints, held if base_manifests is not None else None)
    fetched: list[StoredChunk] = []
    moved = [0]

    def hand_on(c: StoredChunk, data: Buffer) -> None:
        for path, offset in plan.targets[c.id]:
            landed(path, offset, data)

    def count(n: int) -> None:
        moved[0] += n  # (called on the event loop's thread only)

    async def from_store(chunks: list[StoredChunk]) -> None:
        fetched.extend(chunks)
        await fetch_chunks(
            resolver, chunks, part_size=options.part_size, window=options.window,
            sink=hand_on, hints=hints,
        )  # fmt: skip

    zero = bytes(max((size for _, _, size in plan.zeros), default=0))
    for path, offset, size in plan.zeros:
        landed(path, offset, memoryview(zero)[:size])
    maybe_local = set(candidates)
    with ThreadPoolExecutor(options.workers, thread_name_prefix="ferry-mem") as pool:
        resolver = ChunkResolver(store, index, pool, base_dir, on_bytes_read=count)
        early = [index[cid] for cid in plan.targets if cid not in maybe_local]
        try:
            async with asyncio.TaskGroup() as both:  # the disk and the network overlap
                reuse = both.create_task(
                    reuse_local(resolver, index, candidates, hints, hand_on, options.window)
                )
                both.create_task(from_store(early))
        except BaseExceptionGroup as group:  # the first error, as a pull raises it
            raise first_error(group) from None
        local = reuse.result()
        await from_store([index[cid] for cid in candidates if cid not in local])
    return MemRestoreResult(
        bytes_raw=plan.bytes_raw,
        bytes_fetched=moved[0],
        chunks_fetched=len(fetched),
        chunks_local=len(local),
        seconds=time.monotonic() - started,
    )


def whole_files(
    manifests: list[Manifest], paths: Sequence[str]
) -> dict[str, list[tuple[int, int]]]:
    """``wanted`` for whole files of the step (a path it lacks is left for _plan to name)."""
    sizes = {f.path: f.size for f in merged_files(manifests)}
    return {p: [(0, sizes[p])] if p in sizes else [(0, 0)] for p in paths}
