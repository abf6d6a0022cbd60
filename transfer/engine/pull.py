"""pull: manifest(s) -> fetch -> decode -> verify -> staging files -> atomic rename.

The destination either appears complete, with every byte verified against its chunk hash,
or not at all: everything is written into a hidden staging directory beside it, which is
renamed into place at the end and removed on any failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TypeVar

from transfer.codec import check_encoding
from transfer.codec.transforms import Buffer
from transfer.directio import ThreadBuffers
from transfer.engine.catalog import resolve_checkpoint, resolve_manifests
from transfer.engine.chunkindex import ChunkIndex, StoredChunk
from transfer.engine.dcp import MAX_METADATA_BYTES, METADATA
from transfer.engine.dcpshare import overlaps
from transfer.engine.fetch import fetch_chunks
from transfer.engine.localcheck import file_differences
from transfer.engine.parts import check_files_whole, merge_parts
from transfer.engine.progress import Progress
from transfer.engine.pullplan import PullEvents, PullPlan, merged_files
from transfer.engine.ratelimit import RateLimit
from transfer.engine.resolver import ChunkResolver, read_local_into
from transfer.engine.scan import check_base_dir
from transfer.engine.settle import boot_id, fsync_files
from transfer.engine.share import Share, write_record
from transfer.engine.sources import ChunkSource, LocalBase, Sources
from transfer.engine.staging import (
    DestinationLock,
    Staging,
    StagingBusy,
    StagingFiles,
    create_files,
    discard_leftovers,
    lock_destination,
    open_staging,
    seal,
    worth_resuming,
)
from transfer.engine.taskgroup_errors import one_error
from transfer.engine.workers import run_workers
from transfer.engine.writepath import restore_path
from transfer.errors import DestinationError, FerryError
from transfer.format.chunkid import chunk_id
from transfer.format.manifest import FileEntry, Manifest
from transfer.format.names import step_from_dirname
from transfer.format.stepcommon import COMMON_NODE
from transfer.options import TransferOptions
from transfer.store.base import Store

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class PullResult:
    job: str
    step: int
    nodes: list[str]
    files: int
    bytes_raw: int
    bytes_transferred: int
    chunks_total: int
    chunks_deduped: int  # not downloaded: repeats, holes, or reused from --base-dir
    chunks_local: int  # of those, distinct chunks reused from --base-dir
    chunks_resumed: int  # ... found in place in a killed pull's staging dir (staging.py)
    base_dir: str | None  # the node's earlier checkpoint used, if any
    bases_local: int  # delta chunks decoded against their base read from base_dir
    bytes_from_source: int  # raw bytes the chunk_source (peer agents) supplied
    chunks_delta: int  # downloaded and decoded against a base
    chunks_raw: int  # downloaded and decoded on their own
    encode_seconds: float  # codec thread time (decoding and verifying, for a pull)
    stage_seconds: dict[str, float]  # thread time per stage (receive, decode, hash, write...)
    seconds: float
    dest: str
    #: a share's pull: its layout, its bytes, and chunk_bytes: the file bytes its chunks
    #: cover (the share plus the rest of each chunk it cuts through; before dedupe)
    share: dict[str, object] | None = None
    #: "warm", "direct" or "buffered": how its chunks were written (engine/writepath.py);
    #: "none" when nothing was (already_there)
    write_path: str = ""
    #: bytes written into the staging files, and the wall seconds some write was in
    #: progress: their ratio is the rate the disk took them at (writeprobe.write_rate)
    bytes_written: int = 0
    write_busy_seconds: float = 0.0
    #: the destination held the step already, every chunk checked: nothing was written
    already_there: bool = False

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@cache
def zero_chunk_id(size: int) -> str:
    return chunk_id(bytes(size))


async def pull(
    store: Store,
    dest: Path,
    plan: PullPlan,
    sources: Sources | None = None,
    events: PullEvents | None = None,
    options: TransferOptions | None = None,
) -> PullResult:
    """Restore ``plan``'s checkpoint (pullplan.py: which step, parts and share, how
    durable, how fast) into ``dest``, each chunk from the first of ``sources`` that has it
    (sources.py: in place, the node's earlier checkpoint, the chain in order) or else from
    the store, telling ``events`` (pullplan.py) as it goes. ``options``: the transfer's
    sizes and windows."""
    options = options or TransferOptions()
    sources = sources or Sources()
    events = events or PullEvents()
    started = time.monotonic()
    manifests = plan.manifests or await resolve_plan(store, plan)
    base_dir, base_manifests, share = sources.base_dir, sources.base_manifests, plan.share
    check_base_dir(base_dir)
    if base_dir is not None and base_manifests is None:
        base_manifests = await manifests_named_by(store, plan.job, base_dir)
    index = checked_index(manifests)
    # the caller's merge only with the caller's manifests (without them, files are stale)
    merged = plan.files if plan.manifests and plan.files is not None else merged_files(manifests)
    files, targets, hints, clips, covered = _plan_writes(merged, share)
    what = f"{manifests[0].job} step {manifests[0].step}"
    staging = await _staging_unless_there(dest, files, what, share is None, plan.fsync, events)
    if staging is None:
        return _already_there(manifests, files, dest, time.monotonic() - started)
    async with _kept_if_resumable(staging):
        await _to_thread_to_the_end(create_files, staging, files, targets)
        events.progress.start(sum(f.size for f in files), "pull")
        # with --fsync, writeback started per chunk overlaps the final flush with the
        # download; without it the kernel writes back on its own, and starting it per chunk
        # only made writers wait on the disk queue (settle.py flushes later)
        writeback = plan.fsync or boot_id() is None
        # left in the page cache when it fits in spare memory (warm, or buffered): the load
        # that follows reads it there (engine/writepath.py)
        how = restore_path(covered, options.write_path, options.page_cache_first)
        out = StagingFiles(
            staging.path, files, writeback, direct=how != "buffered", warm=how == "warm"
        )
        with out, ThreadPoolExecutor(options.workers, thread_name_prefix="ferry-pull") as pool:
            run = _Restore(
                ChunkResolver(store, index, pool, base_dir),
                staging, files, targets, hints, out, events, options,
            )  # fmt: skip
            got = await run.gather(base_manifests, sources, plan.rate_limit)
            await _to_thread_to_the_end(
                _clear_unwritten, out, files, targets, clips, staging.adopted
            )
        if share is None and plan.node is None:  # every part: together they must be the save
            await _to_thread_to_the_end(_check_whole, staging.path, files, manifests)
        if share is not None:
            job_step = manifests[0].job, manifests[0].step
            await _to_thread_to_the_end(write_record, staging.path, *job_step, share)
        whole = share is None
        # (older leftovers of this destination: nothing will adopt them once it exists)
        await _to_thread_to_the_end(discard_leftovers, dest)
        await _to_thread_to_the_end(seal, staging.path, files, dest, plan.fsync, whole)
    events.progress.finish()
    result = run.result(manifests, got, base_dir, dest, time.monotonic() - started)
    result.write_path = how
    result.bytes_written, result.write_busy_seconds = out.bytes_written, out.busy_seconds
    if share is not None:
        record = share.to_record(result.job, result.step)
        result.share = {k: record[k] for k in ("layout", "bytes")}
        result.share["chunk_bytes"] = covered
    return result


#: how often a restore waiting for another into the same destination looks again, and
#: how often it says it is still waiting
WAIT_POLL_SECONDS = 0.2
WAIT_NOTE_SECONDS = 60.0


async def _staging_unless_there(
    dest: Path, files: list[FileEntry], what: str, whole: bool, fsync: bool, events: PullEvents
) -> Staging | None:
    """The staging directory to restore into (holding ``dest``'s lock), or None when
    ``dest`` holds the step already (``whole``: a pull of the whole step, not a share).
    While another restore into ``dest`` runs (or cleans up after its cancellation), waits
    for it, telling ``events.waiting`` at once and every WAIT_NOTE_SECONDS: then adopts
    what it left, or finds ``dest`` whole."""
    since = told = None
    while True:
        try:
            held = await _to_thread_to_the_end(lock_destination, dest)
            try:
                if whole and await _checked_there(dest, files, what, fsync):
                    await asyncio.to_thread(discard_leftovers, dest)
                    held.release()
                    return None
                return await _to_thread_to_the_end(open_staging, dest, held)
            except BaseException:
                held.release()
                raise
        except StagingBusy as busy:  # (the lock, or an older version's restore's staging)
            now = time.monotonic()
            since = since or now
            if told is None or now - told >= WAIT_NOTE_SECONDS:
                events.waiting(busy.path, busy.holder, now - since)
                told = now
            await asyncio.sleep(WAIT_POLL_SECONDS)


async def _checked_there(dest: Path, files: list[FileEntry], what: str, fsync: bool) -> bool:
    """``_holds_already`` in a thread; cancelled, it stops after the chunk it is on (it
    writes nothing: nothing to wait for)."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(_holds_already, dest, files, what, fsync, stop)
    except asyncio.CancelledError:
        stop.set()
        raise


def _holds_already(
    dest: Path, files: list[FileEntry], what: str, fsync: bool, stop: threading.Event
) -> bool:
    """Whether ``dest``, not empty, already holds every file of the step (``what``) with
    identical bytes, every chunk read back and hash-checked: a pull run again after one
    that was killed once its restore was in place (or run twice) finds its work done.
    Any other non-empty directory is refused, with its first difference. The step's files
    made durable when ``fsync`` asks (only theirs: the rest of the directory is not the
    pull's)."""
    if dest.is_symlink() or not dest.is_dir() or not any(dest.iterdir()):
        return False  # (open_staging says what is wrong with a link or a file)
    problems = file_differences(dest, files, stop, whole_or_nothing=True)
    if stop.is_set():
        return False
    if problems:
        more = f", and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise DestinationError(
            f"{dest} is not empty, and not {what} ({problems[0]}{more}); pull into a new or "
            "empty directory"
        )
    if fsync:
        fsync_files(dest, [f.path for f in files])
    return True


def _already_there(
    manifests: list[Manifest], files: list[FileEntry], dest: Path, seconds: float
) -> PullResult:
    chunks = sum(len(f.chunks) for f in files)
    return PullResult(
        job=manifests[0].job, step=manifests[0].step,
        nodes=[m.node for m in manifests if m.node != COMMON_NODE],
        files=len(files), bytes_raw=sum(f.size for f in files), bytes_transferred=0,
        chunks_total=chunks, chunks_deduped=chunks, chunks_local=0, chunks_resumed=0,
        base_dir=None, bases_local=0, bytes_from_source=0, chunks_delta=0, chunks_raw=0,
        encode_seconds=0.0, stage_seconds={}, seconds=seconds, dest=str(dest.absolute()),
        already_there=True, write_path="none",
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _kept_if_resumable(staging: Staging) -> AsyncIterator[None]:
    """A restore that fails keeps its staging directory if the same pull may resume from
    it (staging.worth_resuming), else removes it; the lock is released either way."""
    try:
        yield
    except BaseException as exc:
        if worth_resuming(exc):
            stopped = isinstance(exc, asyncio.CancelledError | KeyboardInterrupt)
            why = "interrupted" if stopped else type(exc).__name__
            log.warning("kept the partial restore in %s: the same pull resumes from it (%s)",
                        staging.path, why)  # fmt: skip
        else:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, staging.path, True))
        raise
    finally:
        staging.release()


Targets = dict[str, list[tuple[int, int]]]  # chunk id -> [(file index, offset)] to write it
Hints = dict[str, tuple[str, int]]  # chunk id -> its first (path, offset)
#: (file index, offset) of a chunk that a share covers in part -> (its size, the file's
#: ranges of it the share holds)
Clips = dict[tuple[int, int], tuple[int, list[tuple[int, int]]]]


def checked_index(manifests: list[Manifest]) -> ChunkIndex:
    """The chunk index, every encoding one this version decodes (the parser accepts any
    name, and checked that each encoding and its base agree)."""
    index = ChunkIndex()
    for m in manifests:
        index.add_manifest(m)
        for c in m.all_chunks():
            check_encoding(c.enc)
    return index


def _plan_writes(
    files: list[FileEntry], share: Share | None = None
) -> tuple[list[FileEntry], Targets, Hints, Clips, int]:
    """Where each chunk is written, and its first position (path, offset): the hint for
    finding it, or its base, in a local copy. All-zero chunks are left out: the staging
    files start zero-filled (sparse). With ``share``: only its files (a storage file it
    needs nothing of is left out) and the chunks that cover some of its ranges, which of
    those are written only in part (the rest of such a chunk belongs to items outside the
    share: left a hole), and the bytes of the file ranges those chunks cover (all-zero
    chunks included: they cost a hole, not a fetch). Returns (files, targets, hints,
    clips, covered)."""
    kept = [f for f in files if share is None or share.spans_of(f.path) != ()]
    targets: Targets = defaultdict(list)
    hints: Hints = {}
    clips: Clips = {}
    covered = 0
    for fi, f in enumerate(kept):
        spans = None if share is None else share.spans_of(f.path)
        for offset, c in f.chunk_offsets():
            end = offset + c.size
            pieces = [(offset, end)] if spans is None else overlaps(spans, offset, end)
            if not pieces:
                continue
            covered += c.size
            if c.id == zero_chunk_id(c.size):
                continue  # the staging files start zero-filled (sparse)
            if pieces != [(offset, end)]:
                clips[(fi, offset)] = (c.size, pieces)
            targets[c.id].append((fi, offset))
            hints.setdefault(c.id, (f.path, offset))
    return kept, targets, hints, clips, covered


async def resolve_plan(store: Store, plan: PullPlan) -> list[Manifest]:
    """One node's part as asked; else the whole step, complete (a step of a job that writes
    completion markers, without its marker yet, is refused: a node's part is still to
    come, and without rank 0's there is no ``.metadata`` to find the gap by)."""
    if plan.node is not None:
        return await resolve_manifests(store, plan.job, plan.step, plan.node)
    return await resolve_checkpoint(store, plan.job, plan.step, plan.expected_nodes)


def _check_whole(root: Path, files: list[FileEntry], manifests: list[Manifest]) -> None:
    """A restore of every part of a DCP step holds every file its (verified, staged)
    ``.metadata`` names, at full length: a step whose parts are all in but torn (a node's
    part missing a shard) never lands as a whole checkpoint."""
    entry = next((f for f in files if f.path == METADATA), None)
    if entry is None or entry.size > MAX_METADATA_BYTES:
        return
    metadata = (root / METADATA).read_bytes()  # validated relative path, staged and verified
    what = f"{manifests[0].job} step {manifests[0].step}"
    check_files_whole(metadata, {f.path: f.size for f in files}, what, len(manifests))


def share_chunk_ids(files: list[FileEntry], share: Share) -> set[str]:
    """The chunks a pull of ``share`` fetches (a fan-out member's needs), of a step whose
    parts' files merged are ``files`` (pullplan.merged_files)."""
    return set(_plan_writes(files, share)[1])


def chunk_positions(
    files: list[FileEntry], share: Share | None
) -> dict[str, list[tuple[str, int, int]]]:
    """Each chunk a pull of ``share`` (None: the whole step) fetches, and where it goes:
    (path, offset, size) of every position, in file and offset order."""
    kept, targets = _plan_writes(files, share)[:2]
    sizes = {(fi, at): c.size for fi, f in enumerate(kept) for at, c in f.chunk_offsets()}
    return {
        cid: [(kept[fi].path, at, sizes[(fi, at)]) for fi, at in where]
        for cid, where in targets.items()
    }


def _clear_unwritten(
    out: StagingFiles, files: list[FileEntry], targets: Targets, clips: Clips, adopted: bool
) -> None:
    """Zero what the restore must not leave behind. The bytes of each chunk a share cuts
    through that lie outside the share: chunks are written whole while the restore runs (a
    fan-out serves them whole to its members from the staging files), and what is left
    must be exactly the share, so that a rank reading an item outside it finds zeros,
    which torch.load refuses, never another item's bytes. In an adopted staging dir (a
    killed restore's, perhaps of another step), every byte this restore did not write:
    its all-zero chunks and, for a share, everything outside it."""
    for (fi, offset), (size, pieces) in clips.items():
        _zero_gaps(out, fi, offset, offset + size, pieces)
    if not adopted:
        return  # the rest of a new staging file is a hole already
    placed = {pos for positions in targets.values() for pos in positions}
    for fi, f in enumerate(files):
        written: list[tuple[int, int]] = []
        for offset, c in f.chunk_offsets():
            if (fi, offset) in placed:
                clip = clips.get((fi, offset))
                written += [(offset, offset + c.size)] if clip is None else clip[1]
        _zero_gaps(out, fi, 0, f.size, written)  # (positions are in order, disjoint)


def _zero_gaps(
    out: StagingFiles, fi: int, start: int, end: int, keep: list[tuple[int, int]]
) -> None:
    """Clear ``[start, end)`` of file ``fi`` (holes, or zeros) but the sorted ``keep``."""
    at = start
    for lo, hi in [*keep, (end, end)]:
        if at < lo:
            out.clear(fi, at, lo - at)
        at = max(at, hi)


@dataclass
class _Gathered:
    resumed: set[str]  # found in place in an adopted staging dir
    local: set[str]  # ... or reused from base_dir (resumed included)
    sourced: dict[str, int]  # chunk id -> bytes the chunk source moved for it
    fetched: list[StoredChunk]  # from the store


class _Restore:
    """One pull's chunks on their way into the staging files, from the cheapest source
    first: in place (a resumed restore), the node's earlier checkpoint, the chunk source
    (peers; in a fan-out, beside this node's own share from the store), the store."""

    def __init__(
        self,
        resolver: ChunkResolver,
        staging: Staging,
        files: list[FileEntry],
        targets: Targets,
        hints: Hints,
        out: StagingFiles,
        events: PullEvents,
        options: TransferOptions,
    ) -> None:
        self.resolver = resolver
        self.events = events
        self.index = resolver.index
        self.staging = staging
        self.files = files
        self.targets = targets
        self.hints = hints
        self.out = out
        self.progress: Progress = events.progress
        self.options = options
        self.bytes_read = 0
        resolver.on_bytes_read = self._count

    def _count(self, n: int) -> None:
        self.bytes_read += n
        self.events.moved("store", n)

    def write(self, c: StoredChunk, data: Buffer) -> None:
        """(In a worker thread.) A verified chunk, to every position it has."""
        positions = self.targets.get(c.id, ())
        with self.resolver.clock.timing("write"):
            for fi, offset in positions:
                self.out.pwrite(fi, offset, data)
        self.progress.advance(len(data) * max(1, len(positions)))
        self._landed(c.id)

    def write_elsewhere(self, c: StoredChunk, data: Buffer) -> None:
        """A chunk found in place in an adopted staging dir: its other positions."""
        for fi, offset in self.targets[c.id][1:]:
            self.out.pwrite(fi, offset, data)
        self.progress.advance(len(data) * len(self.targets[c.id]))
        self._landed(c.id)

    def _landed(self, cid: str) -> None:
        if cid in self.targets:
            fi, offset = self.targets[cid][0]
            where = (self.staging.path / self.files[fi].path, offset, self.index[cid].size)
            self.events.landed(cid, where)

    async def from_store(self, chunks: list[StoredChunk], rate_limit: RateLimit | None) -> None:
        await fetch_chunks(
            self.resolver,
            chunks,
            part_size=self.options.part_size,
            window=self.options.window,
            sink=self.write,
            hints=self.hints,
            rate_limit=rate_limit,
        )

    def result(
        self,
        manifests: list[Manifest],
        got: _Gathered,
        base_dir: Path | None,
        dest: Path,
        seconds: float,
    ) -> PullResult:
        resolver, files = self.resolver, self.files
        chunks_total = sum(len(f.chunks) for f in files)
        return PullResult(
            job=manifests[0].job,
            step=manifests[0].step,
            nodes=[m.node for m in manifests if m.node != COMMON_NODE],  # (parts, not the index)
            files=len(files),
            bytes_raw=sum(f.size for f in files),
            bytes_transferred=self.bytes_read,
            chunks_total=chunks_total,
            chunks_deduped=chunks_total - len(got.fetched),
            chunks_local=len(got.local) - len(got.resumed),
            chunks_resumed=len(got.resumed),
            base_dir=str(base_dir.absolute()) if base_dir is not None else None,
            bases_local=resolver.local_hits - len(got.local),  # (local counts the resumed too)
            bytes_from_source=sum(got.sourced.values()),
            chunks_delta=sum(1 for c in got.fetched if c.base),
            chunks_raw=sum(1 for c in got.fetched if not c.base),
            encode_seconds=round(resolver.clock.seconds("decode", "hash"), 3),
            stage_seconds=resolver.clock.to_dict(),
            seconds=seconds,
            dest=str(self.staging.path.parent / dest.name),
        )

    async def gather(
        self, base_manifests: list[Manifest] | None, sources: Sources, rate_limit: RateLimit | None
    ) -> _Gathered:
        """Every chunk into place: what an adopted staging dir already holds, then the
        chunks base_dir should hold (read and verified there) while the rest is fetched at
        the same time (disk and network overlap: on a frozen backbone most of a checkpoint
        is local); a candidate that does not verify is fetched after."""
        resolver, index, window = self.resolver, self.index, self.options.window
        resumed: set[str] = set()
        if self.staging.adopted:  # a killed restore's leftover: keep what verifies in place
            resumed = await reuse_local(
                resolver, index, list(self.targets), self.hints, self.write_elsewhere, window,
                root=self.staging.path,
            )  # fmt: skip
        # what base_dir holds where, once: it picks the chunks to read there and the bases
        # offered to the chunk sources
        held = held_at(base_manifests) if resolver.local_root is not None else {}
        known = held if base_manifests is not None else None
        candidates = same_position(self.targets, self.hints, known)
        candidates = [c for c in candidates if c not in resumed]
        maybe_local = set(candidates)
        early = [cid for cid in self.targets if cid not in resumed and cid not in maybe_local]
        remote = _Remote(self, held, sources, rate_limit)
        async with one_error(), asyncio.TaskGroup() as both:
            reuse = both.create_task(
                reuse_local(resolver, index, candidates, self.hints, self.write, window)
            )
            both.create_task(remote.fetch(early))
        local = resumed | reuse.result()
        await remote.fetch([cid for cid in candidates if cid not in local])
        return _Gathered(resumed, local, remote.sourced, remote.fetched)


class _Remote:
    """Chunks not on this node, from the chain of chunk sources (beside the chunks they
    leave to the store, fetched at once) and then the store; what came from where adds
    up over calls. ``held``: what base_dir holds where (held_at)."""

    def __init__(
        self,
        run: _Restore,
        held: dict[tuple[str, int], tuple[str, int]],
        sources: Sources,
        rate_limit: RateLimit | None,
    ) -> None:
        self.run = run
        self.source: ChunkSource | None = sources.ask if sources.chain else None
        self.own_share = sources.store_first if sources.chain else None
        self.ask_first = sources.ask_first
        self.rate_limit = rate_limit
        self.held = held
        self.sourced: dict[str, int] = {}  # chunk id -> bytes the chunk source moved for it
        self.fetched: list[StoredChunk] = []  # from the store

    async def fetch(self, todo: list[str]) -> None:
        run, index, limit = self.run, self.run.index, self.rate_limit
        # a fan-out member's own share goes to the store at once, beside the source
        mine = [index[cid] for cid in todo if self.own_share(cid)] if self.own_share else []
        sourced: dict[str, int] = {}
        now: list[StoredChunk] = []  # not supplied, then this member's: from the store at once

        async def unsupplied(chunk: StoredChunk) -> None:
            if self.own_share is not None and self.own_share(chunk.id):
                await run.from_store([chunk], limit)
                now.append(chunk)

        if self.source is not None:
            root, taken = run.resolver.local_root, {c.id for c in mine}
            ids = [cid for cid in todo if cid not in taken]
            if (first := self.ask_first) is not None:
                ids.sort(key=lambda cid: not first(cid))
            async with one_error(), asyncio.TaskGroup() as both:
                both.create_task(run.from_store(mine, limit))
                sourced = await _from_source(
                    self.source,
                    run.resolver,
                    index,
                    ids,
                    run.write,
                    run.options.window,
                    lambda cid: _local_base(root, self.held, run.hints[cid], cid),
                    _Pace(limit, run.events.moved, unsupplied),
                )
        done = {c.id for c in mine} | set(sourced) | {c.id for c in now}
        rest = [index[cid] for cid in todo if cid not in done]
        await run.from_store(rest, limit)
        self.sourced.update(sourced)
        self.fetched += mine + now + rest


async def manifests_named_by(store: Store, job: str, base_dir: Path) -> list[Manifest] | None:
    """The committed manifests of the step base_dir's name gives (``step_000120``), if the
    store has them: then only the chunks they place unchanged at the same position are
    read from base_dir (without them every position is read and hashed: a whole cold read
    of the old checkpoint before the first download, for nothing on a full fine-tune)."""
    step = step_from_dirname(base_dir.name)
    return None if step is None else await committed_manifests(store, job, step)


async def committed_manifests(store: Store, job: str, step: int) -> list[Manifest] | None:
    """Every part of ``step``, or None when the store has no committed part of it."""
    try:
        return await resolve_manifests(store, job, step)
    except FerryError:
        return None  # not committed here: look at every position, as without a name


def _no_moves(origin: str, nbytes: int) -> None:
    pass


@dataclass(frozen=True)
class _Pace:
    """How a chunk source's bytes are paced and told: the restore's rate cap (waited on
    after each chunk: its size is known only then) and its ``moved`` event."""

    rate_limit: RateLimit | None = None
    moved: Callable[[str, int], None] = _no_moves
    #: told of each chunk the source did not supply (it may fetch it from the store now)
    unsupplied: Callable[[StoredChunk], Awaitable[None]] | None = None


async def _from_source(
    source: ChunkSource,
    resolver: ChunkResolver,
    index: ChunkIndex,
    ids: list[str],
    write: Callable[[StoredChunk, Buffer], None],
    window: int,
    local_base: Callable[[str], LocalBase | None],
    pace: _Pace | None = None,
) -> dict[str, int]:
    """Ask ``source`` for each chunk (offering what this node holds at its position, so a
    peer can send a delta); write the ones whose bytes hash right. Returns {chunk id: bytes
    moved} of those it supplied; failures just leave a chunk to the store."""
    supplied: dict[str, int] = {}
    loop = asyncio.get_running_loop()

    pace = pace or _Pace()
    rate_limit, moved = pace.rate_limit, pace.moved

    landed: set[str] = set()
    gate = _WriteGate()

    def check_and_write(chunk: StoredChunk, data: Buffer) -> bool:
        if len(data) != chunk.size or chunk_id(data) != chunk.id:
            return False  # a confused or hostile peer: fall back to the store
        if not gate.enter():
            return False  # the restore moved on (cancelled): its files may be closed
        try:
            write(chunk, data)
        finally:
            gate.leave()
        landed.add(chunk.id)
        return True

    async def worker(todo: Iterator[str]) -> None:
        for cid in todo:
            chunk = index.get(cid)
            assert chunk is not None
            got = await source(chunk, local_base(cid), check_and_write)
            if got is None:
                if pace.unsupplied is not None:
                    await pace.unsupplied(chunk)
                continue
            data, nbytes, origin = got
            if rate_limit is not None:
                await rate_limit.wait(nbytes)  # after the fact: the size was not known before
            if data is not None:  # a source that does not land chunks itself
                await loop.run_in_executor(resolver.pool, check_and_write, chunk, data)
            if cid in landed:
                supplied[cid] = nbytes
                moved(origin, nbytes)

    try:
        await run_workers(ids, worker, min(window, len(ids)), errors_as_group=True)
    finally:
        gate.close()
    return supplied


class _WriteGate:
    """Lets a chunk source's threads write while the restore gathers, and never after: a
    thread still receiving from a peer when the prefetch is cancelled must not write into
    files the restore has closed (their descriptors may belong to other files by then).
    ``close`` turns later writes away and waits for those under way (one chunk's write
    each, so the event loop waits milliseconds)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False

    def enter(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._active:
                self._cond.wait()


def held_at(base_manifests: list[Manifest] | None) -> dict[tuple[str, int], tuple[str, int]]:
    """(path, offset) -> (chunk id, size) of what base_dir holds there, per its manifests."""
    if not base_manifests:
        return {}
    return {
        (f.path, offset): (c.id, c.size)
        for f, _ in merge_parts(base_manifests)
        for offset, c in f.chunk_offsets()
    }


def _local_base(
    root: Path | None,
    held: dict[tuple[str, int], tuple[str, int]],
    hint: tuple[str, int],
    cid: str,
) -> LocalBase | None:
    """The chunk base_dir holds at ``cid``'s position (read later, if at all)."""
    there = held.get(hint)
    if root is None or there is None or there[0] == cid:
        return None

    def read() -> bytearray | None:
        buf = bytearray(there[1])
        return buf if read_local_into(root, *hint, memoryview(buf)) else None

    return LocalBase(there[0], read)


def local_bases(
    base_dir: Path, base_manifests: list[Manifest], files: list[FileEntry]
) -> dict[str, LocalBase]:
    """For each chunk of ``files`` (a step's parts merged: pullplan.merged_files), what
    ``base_dir`` holds at its position if that differs (a source may send the chunk as a
    delta against it)."""
    held = held_at(base_manifests)
    hints = _plan_writes(files)[2]
    found = {cid: _local_base(base_dir, held, hint, cid) for cid, hint in hints.items()}
    return {cid: base for cid, base in found.items() if base is not None}


def same_position(
    targets: Iterable[str],
    hints: Hints,
    held: dict[tuple[str, int], tuple[str, int]] | None,
) -> list[str]:
    """The target chunks worth looking for in base_dir: all of them, or with its manifests
    known (``held``: what they place where), those it holds at the position where we
    would look. (Without them every chunk's
    position is read and hashed, and on a fully fine-tuned model, where every chunk changed,
    that is a whole cold read of the old checkpoint, for nothing, before the first byte is
    downloaded; the delta path reads each base again anyway.)"""
    if held is None:
        return list(targets)
    return [cid for cid in targets if held.get(hints[cid], ("",))[0] == cid]


async def reuse_local(
    resolver: ChunkResolver,
    index: ChunkIndex,
    candidates: list[str],
    hints: Hints,
    write: Callable[[StoredChunk, Buffer], None],
    window: int,
    root: Path | None = None,
) -> set[str]:
    """Write every candidate chunk that ``root`` (default: base_dir) holds, verified, at the
    same position. A batch of chunks per thread hop, each read into the thread's reused
    buffer (no new ``bytes`` per chunk: on a frozen backbone most of a checkpoint comes
    this way)."""
    found: set[str] = set()
    root = root or resolver.local_root
    if root is None or not candidates:
        return found
    loop = asyncio.get_running_loop()
    buffers = ThreadBuffers()

    def reuse(cid: str) -> None:
        chunk = index.get(cid)
        assert chunk is not None
        view = buffers.view("base", chunk.size)
        path, offset = hints[cid]
        with resolver.clock.timing("base_read"):
            there = read_local_into(root, path, offset, view)
        with resolver.clock.timing("hash"):
            same = there and chunk_id(view) == cid
        if same:
            resolver.count_local_hit()
            write(chunk, view)
            found.add(cid)

    def reuse_batch(ids: list[str]) -> None:
        for cid in ids:
            reuse(cid)

    batch = _REUSE_BATCH
    batches = [candidates[i : i + batch] for i in range(0, len(candidates), batch)]

    async def worker(pending: Iterator[list[str]]) -> None:
        for ids in pending:
            await loop.run_in_executor(resolver.pool, reuse_batch, ids)

    await run_workers(batches, worker, min(window, len(candidates)), errors_as_group=True)
    return found


_REUSE_BATCH = 8  # chunks per thread hop when reusing the held copy (32 MiB at 4 MiB chunks)


async def _to_thread_to_the_end(fn: Callable[..., T], *args: object) -> T:
    """Run ``fn`` in a thread; if we are cancelled meanwhile, let the thread finish before
    the cancellation proceeds, so cleanup never races a thread still creating files."""
    job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        made = None if job.cancelled() or job.exception() else job.result()
        if isinstance(made, Staging):  # opened after we were cancelled
            if not made.adopted:
                shutil.rmtree(made.path, ignore_errors=True)
            made.release()
        elif isinstance(made, DestinationLock):  # taken after we were cancelled
            made.release()
        raise
