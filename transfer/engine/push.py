"""push: checkpoint directory -> chunks -> hash -> dedupe -> delta/encode -> packs -> manifest.

Commit protocol: the manifest is written create-only, and only after every pack it names is
complete (durable), so a reader never sees a manifest whose chunks are missing and a push
that dies at any point leaves no manifest (only unreferenced packs, which GC collects).

Deltas: the base is the newest committed checkpoint of the same job and node before this
step (or ``base_step``). A changed chunk is encoded against the base's chunk at the same file
offset when the keyframe policy says it pays (keyframes.py). Base bytes come
from a local copy when one matches the base manifest's hashes, else from the store.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple, cast

from transfer.codec import (
    RAW,
    DeltaPolicy,
    choose,
    encode,
    encode_chosen,
    needs_base,
    plane_width,
    sample_spans,
)
from transfer.codec.transforms import Buffer
from transfer.engine import dcp
from transfer.engine.catalog import Catalog, load_manifest, not_a_store, open_catalog
from transfer.engine.chunkindex import ChunkIndex, StoredChunk, build_refs
from transfer.engine.chunkspans import GROUP_BYTES, Span, chunk_spans
from transfer.engine.deltabase import BasePlan, choose_base
from transfer.engine.keyframes import delta_policy, may_delta
from transfer.engine.packer import PackLocation, PackWriter
from transfer.engine.parts import may_share
from transfer.engine.progress import NoProgress, Progress
from transfer.engine.pushlease import push_lease
from transfer.engine.pushplan import PushPlan
from transfer.engine.resolver import ChunkResolver
from transfer.engine.resume import ResumeLog
from transfer.engine.scan import (
    SourceFile,
    check_base_dir,
    check_unchanged,
    read_range,
    scan_checkpoint,
    scan_files,
)
from transfer.engine.share import describe, read_record
from transfer.engine.taskgroup_errors import first_error
from transfer.errors import AlreadyExistsError, FerryError, NotFoundError, SourceChangedError
from transfer.format import layout
from transfer.format.chunkid import chunk_id
from transfer.format.manifest import PART_EXTRA, FileEntry, Manifest
from transfer.format.names import check_name, check_step
from transfer.format.share import SHARE_MARKER
from transfer.options import TransferOptions
from transfer.store.base import PartReceipt, Store

log = logging.getLogger(__name__)

#: Every this many bytes of a file, the codec tries every candidate again instead of only
#: those of the plane width the file's previous chunk chose (encodings.encode's ``width``):
#: every 8th chunk of fixed 4 MiB ones, as many bytes apart whatever the cut.
RESAMPLE_BYTES = 32 << 20
#: The smallest chunk that takes or gives that width: a chunk of a DCP file's small items
#: (chunkspans.py: step counters, param_groups, LayerNorm shards, each ~2 KB and mostly its
#: zip headers and pickle) is coded without byte planes, zstd or XOR + zstd. When those
#: chunks set the width, the tensors after them tried only plain zstd and the corpus's
#: keyframes grew 4.8%; sampling every candidate on each of them cost a push of the
#: 1.69 GB save ~0.6 CPU-s, for 0.4% of its bytes.
HINT_BYTES = GROUP_BYTES


@dataclass
class PushResult:
    job: str
    step: int
    node: str
    files: int
    bytes_raw: int
    bytes_transferred: int
    chunks_total: int
    chunks_new: int
    #: total - new - resumed: stored before this push, or repeated within it
    chunks_deduped: int
    #: stored by an interrupted attempt of this push (its resume log), not sent again
    chunks_resumed: int
    chunks_delta: int  # new chunks stored as a delta against the base
    chunks_raw: int  # new chunks stored on their own (raw or compressed): keyframes
    encode_seconds: float  # thread time spent delta-coding and compressing
    base_step: int | None
    base_local: bool  # base bytes came from a verified local copy
    packs: int
    seconds: float
    already_committed: bool = False

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


async def push(
    store: Store,
    ckpt_dir: Path,
    *,
    job: str,
    step: int,
    node: str,
    options: TransferOptions | None = None,
    progress: Progress | None = None,
    plan: PushPlan | None = None,
) -> PushResult:
    """Push ``ckpt_dir`` as (job, step, node), made as ``plan`` says (pushplan.py: the
    delta base, a keyframe, resuming an interrupted attempt, a part of a multi-node save,
    whether a store may be made here); the default pushes a whole save.

    Reads of the store's control objects do not grow with the job's nodes: the node's own
    head and newest parts (its base and dedupe window), and one listing of the step; other
    nodes' manifests only for a push that is not a part (a single-node save: it has
    none, unless the same step was pushed under another node name)."""
    options = options or TransferOptions()
    progress = progress or NoProgress()
    plan = plan or PushPlan()
    base_dir, resume, part = plan.base_dir, plan.resume, plan.part
    check_name("job", job)
    check_name("node", node)
    check_step(step)
    started = time.monotonic()
    check_base_dir(base_dir)
    sources = await asyncio.to_thread(_complete_sources, ckpt_dir, part, plan.files)
    if not await open_catalog(store, create=plan.create_store):
        raise not_a_store(store.url)
    catalog = Catalog(store)
    # one push of a part at a time: a second one waits, then finds it committed
    async with push_lease(store, job, step, node):
        others = [] if part else await _other_parts(catalog, job, step, node)
        if (why := _clash(sources, others)) is not None:
            raise _clash_error(job, step, node, why)
        base = None
        if options.delta and not plan.full:
            base = await choose_base(
                catalog, ckpt_dir, job=job, step=step, node=node, base_step=plan.base_step,
                base_dir=base_dir,
            )  # fmt: skip
        index, resumed = await _known_chunks(catalog, job, node, options, base, resume)
        run = _PushRun(store, options, index, progress, base, resume, resumed)
        with ThreadPoolExecutor(options.workers, thread_name_prefix="ferry-push") as pool:
            run.pool = pool
            run.resolver = ChunkResolver(store, index, pool, base.local_dir if base else None)
            placed = await run.encode_all(sources)
        await run.check_unchanged(ckpt_dir, sources, only=plan.files is not None)
        manifest = _manifest(job, step, node, options, sources, placed, index, part)
        if (why := _clash(manifest, others)) is not None:
            await run.writer_abort()  # nobody will reference what we wrote
            raise _clash_error(job, step, node, why)
        already = await _commit(store, manifest, run)
        await catalog.record_head(job, node, step)
        progress.finish()
        return run.result(manifest, already, time.monotonic() - started)


def _complete_sources(
    ckpt_dir: Path, part: bool, own: frozenset[str] | None = None
) -> list[SourceFile]:
    """The save's files; a save whose commit marker names files not (fully) there yet is
    never pushed (a part: files it holds that are not fully there). ``own``: only these,
    this node's part, which other files (even a partial copy's) were added beside."""
    if own is not None:
        return _own_sources(ckpt_dir, own)
    record = read_record(ckpt_dir)
    if record is not None:
        raise FerryError(
            f"{ckpt_dir} is a partial copy ({describe(record)} of "
            f"{record.get('job')} step {record.get('step')}, {SHARE_MARKER}), not a save: "
            "only what training saved is pushed"
        )
    sources = scan_checkpoint(ckpt_dir)
    if not sources:
        # committing it would claim the step: the real save, pushed next, would then be
        # refused as "already committed with different content"
        raise FerryError(
            f"{ckpt_dir} holds no files: nothing to push (is the save still being written?)"
        )
    dcp.check_complete(ckpt_dir, {f.path: f.size for f in sources}, part=part)
    return sources


def _own_sources(ckpt_dir: Path, own: frozenset[str]) -> list[SourceFile]:
    """The files ``own`` names, every one of them; what else the directory holds is not
    this node's to push."""
    sources = scan_files(ckpt_dir, own)
    if missing := sorted(own - {f.path for f in sources}):
        raise FerryError(
            f"{ckpt_dir} lacks {len(missing)} file(s) of this node's part "
            f"(e.g. {missing[0]!r}): it was changed after a prefetch added to it"
        )
    dcp.check_complete(ckpt_dir, {f.path: f.size for f in sources}, part=True)
    return sources


async def _known_chunks(
    catalog: Catalog,
    job: str,
    node: str,
    options: TransferOptions,
    base: BasePlan | None,
    resume: ResumeLog | None,
) -> tuple[ChunkIndex, set[str]]:
    """What the push can reuse: the node's recent stored chunks (dedupe), the base's, and
    those an interrupted attempt of this push left durable (their ids too, the last not
    known otherwise: a resumed push says it sent them before, not that it deduplicated
    them)."""
    store = catalog.store
    index = await ChunkIndex.load(catalog, job, node, options.dedupe_steps)
    if base is not None:
        index.add_manifest(base.manifest)
    resumed: set[str] = set()
    if resume is not None:
        for chunk in await _still_stored(store, resume.chunks(), resume.parts()):
            if index.get(chunk.id) is None:
                resumed.add(chunk.id)
            index.add(chunk)
    return index, resumed


def _manifest(
    job: str,
    step: int,
    node: str,
    options: TransferOptions,
    sources: Sequence[SourceFile],
    placed: list[list[StoredChunk]],
    index: ChunkIndex,
    part: bool = False,
) -> Manifest:
    """The manifest of the pushed files: their chunks, and the delta bases those need;
    ``extra.part`` when pushed as one node's part of a multi-node save (FORMAT.md)."""
    file_ids = [c.id for chunks in placed for c in chunks]
    in_files = set(file_ids)
    bases = [b for b in index.closure(file_ids) if b.id not in in_files]
    pack_ids, refs, base_refs = build_refs(placed, bases)
    return Manifest(
        job=job,
        step=step,
        node=node,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        chunk_size=options.chunk_size,
        packs=pack_ids,
        files=tuple(
            FileEntry(src.path, src.size, src.mode, file_refs)
            for src, file_refs in zip(sources, refs, strict=True)
        ),
        bases=base_refs,
        extra={PART_EXTRA: True} if part else {},
    )


async def _commit(store: Store, manifest: Manifest, run: _PushRun) -> bool:
    """Write the manifest, create-only, once every pack it names is there; True if the same
    content was committed already (a re-push, or our own attempt whose reply was lost)."""
    job, step, node = manifest.job, manifest.step, manifest.node
    await _check_reused_packs(store, set(manifest.packs) - set(run.new_packs), run)
    blob = manifest.to_json()
    try:
        await store.put(layout.manifest_key(job, step, node), blob, create_only=True)
        run.bytes_stored += len(blob)
        return False
    except AlreadyExistsError:
        existing = await load_manifest(store, job, step, node)
        if existing.same_content(manifest):
            return True  # (then it may reference the packs we just wrote: keep them)
        await run.writer_abort()  # our new packs are referenced by nobody
        if existing.chunk_size != manifest.chunk_size:  # (ids of other cuts never match)
            raise FerryError(
                f"{job} step {step} node {node} is already committed, cut in chunks of "
                f"{existing.chunk_size:,} bytes, and this push cut {manifest.chunk_size:,}: "
                "the two cannot be compared (the bytes may well be the same); push again "
                "with the committed chunk size to check, or under a new step"
            ) from None
        raise FerryError(
            f"{job} step {step} node {node} is already committed with different content; "
            "push it under a new step"
        ) from None


class _PushRun:
    """State of one push: the dedupe index, the base, the pack writer, counters."""

    def __init__(
        self,
        store: Store,
        options: TransferOptions,
        index: ChunkIndex,
        progress: Progress,
        base: BasePlan | None,
        resume: ResumeLog | None = None,
        resumed: set[str] | None = None,
    ) -> None:
        self.resume = resume
        #: ids an interrupted attempt stored, not yet placed by this one (then counted)
        self.resumed = resumed or set()
        self.chunks_resumed = 0
        self.store = store
        self.options = options
        self.index = index
        self.progress = progress
        self.base = base
        self.pool: ThreadPoolExecutor | None = None
        self.resolver: ChunkResolver | None = None
        self.new_packs: list[str] = []
        self.bytes_stored = 0
        self.chunks_total = 0
        self.chunks_new = 0
        self.chunks_delta = 0
        self.encode_seconds = 0.0
        self._encode_lock = threading.Lock()
        self._widths: dict[str, int] = {}  # file path -> plane width its last chunk chose
        # chunks first seen in this push: id -> future of its location (others wait on it)
        self._pending: dict[str, asyncio.Future[StoredChunk]] = {}
        self._writer: PackWriter | None = None

    def _stored(self, nbytes: int) -> None:
        self.bytes_stored += nbytes

    def _pack_durable(self, pack_id: str, members: list[tuple[object, PackLocation]]) -> None:
        assert self.resume is not None
        chunks = []
        for tag, where in members:
            t = cast(_Tag, tag)
            chunks.append(
                StoredChunk(t.cid, t.size, t.enc, pack_id, where.offset, where.stored, t.base)
            )
        self.resume.pack_durable(chunks)

    async def abandon(self) -> None:
        """Give up before the commit: packs whose chunks a caller journaled stay for a
        resumed attempt (their chunks are content-addressed, so still valid), the rest go."""
        if self._writer is not None:
            await self._writer.abort()

    async def writer_abort(self) -> None:
        """Delete every pack this push wrote: none can ever be referenced (not even by a
        resumed attempt: the step is committed with other content)."""
        if self._writer is not None:
            await self._writer.abort(keep_reported=False)

    async def check_unchanged(
        self, ckpt_dir: Path, sources: list[SourceFile], *, only: bool
    ) -> None:
        """What was read must be what is on disk now, or the manifest would commit a torn
        copy: if not, abandon what this push wrote and raise SourceChangedError. ``only``:
        the push is of some of the directory's files (PushPlan.files)."""
        try:
            check = functools.partial(check_unchanged, only=only)
            await asyncio.to_thread(check, ckpt_dir, sources)
        except SourceChangedError:
            await self.abandon()
            raise

    def result(self, manifest: Manifest, already: bool, seconds: float) -> PushResult:
        base = self.base
        return PushResult(
            job=manifest.job,
            step=manifest.step,
            node=manifest.node,
            files=len(manifest.files),
            bytes_raw=manifest.bytes_raw,
            bytes_transferred=self.bytes_stored,
            chunks_total=self.chunks_total,
            chunks_new=self.chunks_new,
            chunks_deduped=self.chunks_total - self.chunks_new - self.chunks_resumed,
            chunks_resumed=self.chunks_resumed,
            chunks_delta=self.chunks_delta,
            chunks_raw=self.chunks_new - self.chunks_delta,
            encode_seconds=round(self.encode_seconds, 3),
            base_step=base.manifest.step if base else None,
            base_local=bool(base and base.local_dir and self.resolver and self.resolver.local_hits),
            packs=len(self.new_packs),
            seconds=seconds,
            already_committed=already,
        )

    async def encode_all(self, sources: list[SourceFile]) -> list[list[StoredChunk]]:
        size = self.options.chunk_size
        slots: list[list[StoredChunk | None]] = [[] for _ in sources]
        work: asyncio.Queue[tuple[int, int, Span] | None] = asyncio.Queue(
            maxsize=self.options.workers
        )
        self.progress.start(sum(f.size for f in sources), "push")
        try:
            async with asyncio.TaskGroup() as tasks:
                self._writer = PackWriter(
                    self.store,
                    tasks,
                    part_size=self.options.part_size,
                    pack_size=self.options.pack_size,
                    window=self.options.window,
                    on_bytes_stored=self._stored,
                    on_pack_durable=self._pack_durable if self.resume else None,
                    on_part_receipt=self.resume.part_sent if self.resume else None,
                )
                # one more worker than threads, so a thread is never idle waiting on the loop
                workers = [
                    tasks.create_task(self._worker(work, sources, slots))
                    for _ in range(self.options.workers + 1)
                ]
                # the files' cuts (chunkspans.py: a few small reads per item) are made in one
                # thread, file after file, ahead of the workers: they never wait for one
                cuts: asyncio.Queue[list[Span]] = asyncio.Queue()
                tasks.create_task(_cut_in_order(sources, size, cuts))
                for fi in range(len(sources)):
                    spans = await cuts.get()
                    slots[fi] = [None] * len(spans)
                    for ci, span in enumerate(spans):
                        await work.put((fi, ci, span))
                for _ in workers:
                    await work.put(None)
                for w in workers:
                    await w
                self.new_packs = await self._writer.finish()
        except BaseException as exc:
            if self._writer is not None:
                stopped = isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt))
                await asyncio.shield(self._writer.abort(interrupted=stopped))
            raise first_error(exc) from None
        return [[c for c in file_slots if c is not None] for file_slots in slots]

    async def _worker(
        self,
        work: asyncio.Queue[tuple[int, int, Span] | None],
        sources: list[SourceFile],
        slots: list[list[StoredChunk | None]],
    ) -> None:
        loop = asyncio.get_running_loop()
        while (item := await work.get()) is not None:
            fi, ci, (offset, length) = item
            src = sources[fi]
            delta = self._delta_plan(src.path, offset, length)
            chunk = await loop.run_in_executor(self.pool, self._prepare, src, offset, length, delta)
            slots[fi][ci] = await self._place(chunk, delta)
            self.progress.advance(length)

    def _delta_plan(self, path: str, offset: int, length: int) -> _DeltaPlan | None:
        """Whether the chunk at (path, offset) may be a delta, against which base chunk.
        Never one under HINT_BYTES (a DCP file's small items): its saving is a few KB, and
        a restore holding the base would read the base's bytes for it, one small read
        each (a pull of the 289 MB fine-tune holding k read its base 0.75-1.0 s against
        0.33 s when ~120 such chunks were deltas)."""
        if self.base is None or self.options.zstd_level is None or length < HINT_BYTES:
            return None
        base_ref = self.base.chunk_at(path, offset)
        if base_ref is None or not may_delta(self.index, base_ref.id, self.options):
            return None  # keyframe: keeps every restore within max_chain decode steps
        pays = delta_policy(self.index, base_ref.id, self.options)
        return _DeltaPlan(base_ref.id, base_ref.size, (path, offset), pays)

    def _prepare(
        self, src: SourceFile, offset: int, length: int, delta: _DeltaPlan | None
    ) -> _Chunk:
        """In a worker thread, all of a chunk's work in one hop: read and hash it and, when
        it is new, encode it (against its base when a delta may pay and the base is at
        hand locally). One hop instead of three kept the threads busy: a local delta push
        of the 1.69 GB save went from 205-222 to 280-330 MB/s with the other changes of
        that commit. The index is only read here (a dict lookup is atomic); a chunk it
        misses while another thread stores it costs one wasted encode, and _place decides."""
        data = read_range(src.abspath, offset, length)
        cid = chunk_id(data)
        chunk = _Chunk(cid, data)
        if self.index.get(cid) is not None or cid in self._pending:
            return chunk  # stored already: nothing to encode
        width = self._width_hint(src.path, offset, length)
        if delta is None:
            chunk.encoded = _encode(
                data, self.options.zstd_level, None, None, self.clock_encode, width
            )
        else:
            chunk.encoded = self._encode_against_local(data, delta, width)
        if chunk.encoded is not None and chunk.encoded[0] != RAW and length >= HINT_BYTES:
            self._widths[src.path] = plane_width(chunk.encoded[0])
        return chunk  # not encoded: the base must come from the store (_store_new)

    def _encode_against_local(
        self, data: Buffer, delta: _DeltaPlan, width: int | None
    ) -> tuple[str, bytes, str | None] | None:
        """Encode with the base's local copy, reading only its sample spans to choose, and
        all of it (verified) only when a delta is chosen: the keyframe policy keys about
        two thirds of a full fine-tune's chunks, whose base is then never read or hashed.
        None when the local copy is missing or is not the base."""
        assert self.resolver is not None and self.options.zstd_level is not None
        level = self.options.zstd_level
        if delta.base_size != len(data):
            return None  # the file changed size: the store path aligns what it can
        spans = sample_spans(len(data))
        samples = self.resolver.read_local_samples(delta.hint, spans)
        if samples is None:
            return None
        began = time.perf_counter()
        enc = choose(data, level, samples, delta.pays, width)
        spent = time.perf_counter() - began
        base = None
        if needs_base(enc):
            base = self.resolver.read_local(delta.base_id, delta.base_size, delta.hint)
            if base is None:
                return None
        began = time.perf_counter()
        enc, payload = encode_chosen(enc, data, level, base)
        self.clock_encode(spent + time.perf_counter() - began)
        return enc, payload, delta.base_id if needs_base(enc) else None

    def _width_hint(self, path: str, offset: int, length: int) -> int | None:
        """The plane width this file's chunks were coded with, so the codec samples only
        the candidates of that width (a third of them); None for the chunk that holds each
        RESAMPLE_BYTES-th byte of the file, which tries them all again (a file may hold
        tensors of several dtypes); 1 (no planes) for a chunk under HINT_BYTES."""
        if length < HINT_BYTES:
            return 1
        if (offset + length - 1) // RESAMPLE_BYTES != (offset - 1) // RESAMPLE_BYTES:
            return None
        return self._widths.get(path)

    def clock_encode(self, seconds: float) -> None:
        with self._encode_lock:  # called from the worker threads
            self.encode_seconds += seconds

    async def _place(self, chunk: _Chunk, delta: _DeltaPlan | None) -> StoredChunk:
        """Where ``chunk`` lives: already stored, being stored by this push, or new."""
        self.chunks_total += 1
        known = self.index.get(chunk.id)
        if known is None and chunk.id in self._pending:
            known = await self._pending[chunk.id]
        if known is not None:
            if chunk.id in self.resumed:  # (its first position: a repeat is a dedupe)
                self.resumed.discard(chunk.id)
                self.chunks_resumed += 1
            return known
        future: asyncio.Future[StoredChunk] = asyncio.get_running_loop().create_future()
        self._pending[chunk.id] = future
        try:
            stored = await self._store_new(chunk, delta)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: the worker's own error is what surfaces
            raise
        future.set_result(stored)
        self.index.add(stored)
        self.chunks_new += 1
        return stored

    async def _remote_base(self, delta: _DeltaPlan) -> Buffer | None:
        """The base chunk's bytes from the store (no local copy of it), or None."""
        assert self.resolver is not None
        try:
            return await self.resolver.raw(delta.base_id, delta.hint)
        except FerryError as exc:  # a delta is an optimisation: fall back to a keyframe
            log.warning("base chunk %s unavailable, storing a keyframe: %s", delta.base_id, exc)
            return None

    async def _store_new(self, chunk: _Chunk, delta: _DeltaPlan | None) -> StoredChunk:
        if chunk.encoded is None:  # _prepare left it: its base is not local, or it raced
            base = await self._remote_base(delta) if delta is not None else None
            chunk.encoded = await asyncio.get_running_loop().run_in_executor(
                self.pool, _encode, chunk.data, self.options.zstd_level, base,
                delta if base is not None else None, self.clock_encode,
            )  # fmt: skip
        enc, payload, base_id = chunk.encoded
        self.chunks_delta += base_id is not None
        size = len(chunk.data)
        assert self._writer is not None
        where = await self._writer.add(payload, _Tag(chunk.id, size, enc, base_id))
        return StoredChunk(chunk.id, size, enc, where.pack_id, where.offset, where.stored, base_id)


async def _cut_in_order(
    sources: Sequence[SourceFile], chunk_size: int, cuts: asyncio.Queue[list[Span]]
) -> None:
    for src in sources:
        await cuts.put(await asyncio.to_thread(chunk_spans, src.abspath, src.size, chunk_size))


class _DeltaPlan(NamedTuple):
    """A chunk may be stored as a delta against ``base_id`` (found locally at ``hint``),
    when ``pays`` (the keyframe policy) agrees."""

    base_id: str
    base_size: int
    hint: tuple[str, int]
    pays: DeltaPolicy


@dataclass(slots=True)
class _Chunk:
    """A chunk read and hashed, and once encoded: (encoding, payload, its base's id)."""

    id: str
    data: Buffer
    encoded: tuple[str, bytes, str | None] | None = None


class _Tag(NamedTuple):
    """What the pack writer carries for each chunk, to report it when the pack is durable."""

    cid: str
    size: int
    enc: str
    base: str | None


def _clash(ours: Manifest | list[SourceFile], others: list[Manifest]) -> str | None:
    """Why the parts of one step (one per node) would not merge into one checkpoint, or
    None. Two parts may hold the same file only with the same bytes (a replicated
    .metadata); the usual cause is the same checkpoint pushed again under another node name
    (the host name is the default). Judged by size before reading (``ours`` the scanned
    sources), by the parts' rule (parts.may_share) before the commit (``ours`` the
    manifest)."""
    mine: dict[str, FileEntry | SourceFile]
    mine = {f.path: f for f in (ours.files if isinstance(ours, Manifest) else ours)}
    for other in others:
        for f in other.files:
            have = mine.get(f.path)
            if have is None:
                continue
            agrees = may_share(have, f) if isinstance(have, FileEntry) else have.size == f.size
            if not agrees:
                return f"{f.path} differs from node {other.node}'s"
    return None


def _clash_error(job: str, step: int, node: str, why: str) -> FerryError:
    return FerryError(
        f"{job} step {step} already has another node's part and this push as node {node} "
        f"would make it unrestorable: {why} (the same checkpoint under another node name? "
        "pass --node with the name it was pushed as)"
    )


async def _other_parts(catalog: Catalog, job: str, step: int, node: str) -> list[Manifest]:
    """The step's other parts, for the clash check of a push that is not a part of a
    multi-node save: one listing of the step, and its other parts' manifests, which a
    single-node job does not have (a multi-node part is judged with the whole step, once,
    by parts.check_step_whole: reading every other part here made each push of an N-node
    job read N manifests)."""
    return [
        await catalog.manifest(job, step, c.node)
        for c in await catalog.parts(job, step)
        if c.node != node
    ]


async def _check_reused_packs(store: Store, pack_ids: set[str], run: _PushRun) -> None:
    """Right before committing: every pack this push reuses but did not write must still
    exist. Retention's grace period already covers a push, and this narrows what is left
    of the race to the time between these HEADs and the manifest PUT."""
    limit = asyncio.Semaphore(16)

    async def exists(pack_id: str) -> bool:
        async with limit:
            return await store.exists(layout.pack_key(pack_id))

    ordered = sorted(pack_ids)
    present = await asyncio.gather(*(exists(p) for p in ordered))
    for pack_id, there in zip(ordered, present, strict=True):
        if not there:
            await run.writer_abort()
            raise FerryError(
                f"pack {pack_id}, which this push deduplicated against, was deleted while it "
                "ran (retention's grace period is shorter than the push); push again"
            )


async def _still_stored(
    store: Store, chunks: Iterable[StoredChunk], receipts: Mapping[str, Sequence[PartReceipt]]
) -> list[StoredChunk]:
    """The resumable chunks that are in the store: in a pack that is there (GC may have
    taken it), or in the landed part of a pack the interrupted attempt left unfinished,
    which is completed with what landed (its writer is dead: this push resumes it)."""
    chunks = list(chunks)
    length: dict[str, int] = {}
    for pack_id in {c.pack_id for c in chunks}:
        key = layout.pack_key(pack_id)
        try:
            length[pack_id] = (await store.head(key)).size
        except NotFoundError:
            length[pack_id] = await store.salvage_upload(key, receipts.get(pack_id, ())) or 0
    return [c for c in chunks if c.offset + c.stored <= length[c.pack_id]]


def _encode(
    data: Buffer,
    level: int | None,
    base: Buffer | None,
    delta: _DeltaPlan | None,
    clock: Callable[[float], None],
    width: int | None = None,
) -> tuple[str, bytes, str | None]:
    """(encoding, payload, the base's id if it is a delta) of a new chunk, timed."""
    began = time.perf_counter()
    enc, payload = encode(data, level, base, delta.pays if delta is not None else None, width)
    clock(time.perf_counter() - began)
    return enc, payload, delta.base_id if delta is not None and needs_base(enc) else None
