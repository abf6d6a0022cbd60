"""Prefetch jobs: materialise a whole checkpoint (every node's part) in this node's hot dir
before the scheduler needs it, reusing what the node already holds.

A job pulls from the tiers in order (the first that has the checkpoint whole; on failure the
next), with the newest local checkpoint of the same job as the base, into a staging
directory that is renamed into place only when every chunk is verified. It never
overwrites a checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import enum
import functools
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.daemon.logs import event
from agent.node.drain import drain_tasks
from agent.node.estimate import BandwidthMeter, peer_key
from agent.node.hotdir import HotDir, LocalCheckpoint, path_in_step_dir
from agent.node.protected import StepHolds
from agent.node.writechoice import record_choice
from agent.peers.chunks import PeerSource, file_holders
from agent.peers.fanout import FanoutSource, Landing
from agent.rpc.services import Spawn, own_task
from transfer.durable import fsync_dir
from transfer.engine import PullEvents, PullPlan, Sources, TransferOptions, pull, warmcache
from transfer.engine.catalog import Catalog, missing, resolve_checkpoint, resolve_manifests
from transfer.engine.dcpshare import Layout, Ranges, merge_ranges
from transfer.engine.localcheck import local_copy_differences
from transfer.engine.parts import drop_common_index
from transfer.engine.pull import chunk_positions
from transfer.engine.pullplan import merged_files
from transfer.engine.ratelimit import RateLimit
from transfer.engine.restorenames import staging_path
from transfer.engine.scan import SourceFile, check_unchanged, scan_checkpoint
from transfer.engine.settle import settle
from transfer.engine.share import (
    Share,
    base_dir_parts,
    plan_fill,
    plan_share,
    plan_shares,
    replace_record,
    resolve_shares,
)
from transfer.engine.sources import ChunkSource
from transfer.engine.staging import discard_leftovers, sweep_stale_staging
from transfer.engine.stepparts import index_chunks
from transfer.engine.writepath import fits_in_spare_memory, page_cache_first, warm_rate
from transfer.engine.writeprobe import DiskProbe, probe_size, probe_write, write_rate
from transfer.errors import (
    CheckpointNotFoundError,
    DestinationError,
    FerryError,
    IncompleteStepError,
    IntegrityError,
    SourceChangedError,
    StoreError,
)
from transfer.format.manifest import FileEntry, Manifest
from transfer.format.paths import check_relative_path
from transfer.retention import pin, unpin
from transfer.store.base import Store

log = logging.getLogger(__name__)

#: the longest a prefetch pins its step in a store (a dead agent's pin expires by then)
PREFETCH_PIN_SECONDS = 3600.0

#: Rounds of the start-up write probe, each way in turn; the best rate of each way counts.
#: An agent's start is rarely quiet (a standby's first copy, training starting, the other
#: agents of a test bed). Three agents started together (bench.decision_to_loaded) probed
#: one disk buffered at 148 MB/s, 174 MB/s and 3,532 MB/s, direct at 1,526, 931 and 547:
#: two of them then wrote every restore warm, the slower way on that machine (prefetch of a
#: 289 MB step holding the one before, 4 runs each: warm 0.71-0.80 s, buffered 0.46-0.62 s).
#: Other work only ever slows a probe, so the best of a few is the disk's own. A further
#: round only while the rounds so far took less than WRITE_PROBE_BUDGET_SECONDS: on a slow
#: volume (20 MB/s) one round is seconds, at the start of a node whose training may be
#: saving; on a fast disk under the start's other work a round took 0.3-0.6 s, and with a
#: budget of one second one of three agents still chose the slower way.
WRITE_PROBE_ROUNDS = 3
WRITE_PROBE_BUDGET_SECONDS = 3.0


class State(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = {State.READY, State.FAILED, State.CANCELLED}


@dataclass
class PrefetchJob:
    id: str
    job: str
    step: int | None  # None: latest at the time the job starts
    deadline_s: float | None
    state: State = State.QUEUED
    bytes_total: int = 0
    bytes_done: int = 0
    #: bytes moved per source, live: ``tier:<name>`` and ``peer`` (all peers)
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    #: ... and per peer agent, by URL (live)
    bytes_by_peer: dict[str, int] = field(default_factory=dict)
    dest: str | None = None
    error: str | None = None
    #: the kind of failure, as an RPC error's ``type`` names it (CheckpointNotFoundError,
    #: StoreError, ...; "Timeout" past the deadline); None unless it failed
    error_type: str | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    task: asyncio.Task[None] | None = None
    eta_rate: float = 0.0  # bytes/s used for the ETA (measured average of the source)
    chunks_local: int = 0  # chunks rebuilt from a checkpoint this node already held
    #: chunks an earlier, interrupted restore of this step had already written (staging.py)
    chunks_resumed: int = 0
    #: cancelled by request: its partial restore is removed, not kept to resume
    discard_partial: bool = False
    #: how a ready prefetch was satisfied: "held" (the step was here already, checked),
    #: "replica" (a standby replication put it here: unchanged since it was verified),
    #: "filled_in" (this node's part was here; the others were added) or "restored"
    satisfied_by: str | None = None
    #: a standby's replication (agent/node/standby.py): rate-capped, never the scheduler's wait
    background: bool = False
    #: seconds spent restoring or re-checking bytes; the rest of its time is its fixed part
    moving_seconds: float = 0.0
    #: a fan-out restore (agent/peers/fanout.py): every member's agent URL, and this agent's
    fanout: tuple[tuple[str, ...], str] | None = None
    #: ... and the layout of each member prefetching a share (by URL)
    fanout_layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: only the share these ranks of a new world read (``{"world_size", "ranks"}``, as the
    #: request gave it: transfer/engine/share.py), or an explicit item list; None: all
    layout: dict[str, Any] | None = None
    items: list[Any] | None = None
    #: the share, planned while its step was resolved from only the parts it touches
    #: (share.resolve_share); None: resolved from every part
    planned: Share | None = field(default=None, repr=False)
    #: a fan-out member's: every other member's share (by URL), once planned
    group_shares: dict[str, Share | None] | None = field(default=None, repr=False)
    #: whether the step's marker's common index may stand in for parts: at all (the
    #: asker's choice: a benchmark measures without it), in this attempt (off, for a tier,
    #: once it named a chunk the tier does not have where it said); and the chunks this
    #: attempt takes from it
    use_index: bool = field(default=True, repr=False)
    index_ok: bool = field(default=True, repr=False)
    index_chunks: frozenset[str] = field(default=frozenset(), repr=False)
    #: set once the state is final: what ``GET /v1/prefetch/{id}?wait=`` waits for
    ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def to_dict(self) -> dict[str, Any]:
        remaining = max(self.bytes_total - self.bytes_done, 0)
        known = self.eta_rate and self.bytes_total and self.state == State.RUNNING
        eta = remaining / self.eta_rate if known else None
        return {
            "id": self.id,
            "job": self.job,
            "step": self.step,
            "state": self.state.value,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "bytes_by_source": dict(self.bytes_by_source),
            "bytes_by_peer": dict(self.bytes_by_peer),
            "chunks_local": self.chunks_local,
            "chunks_resumed": self.chunks_resumed,
            "satisfied_by": self.satisfied_by,
            "background": self.background,
            "layout": self.layout,
            "items": None if self.items is None else len(self.items),
            "eta_seconds": eta,
            "dest": self.dest,
            "error": self.error,
            "error_type": self.error_type,
            "seconds": (self.finished or time.time()) - self.started if self.started else None,
        }


class _JobProgress:
    """Feeds pull's progress (bytes restored, all sources) into the job record."""

    def __init__(self, job: PrefetchJob) -> None:
        self.job = job

    def start(self, total_bytes: int, what: str) -> None:
        self.job.bytes_total = total_bytes

    def advance(self, nbytes: int) -> None:
        self.job.bytes_done += nbytes

    def finish(self) -> None:
        pass


@dataclass(frozen=True)
class PrefetchPolicy:
    """How this node prefetches. ``concurrency``: prefetches running at once;
    ``expected_nodes``: the job's nodes, whose parts make a step whole; ``pin_holder``: pin
    the step in a tier's store while it is pulled from there (no node's retention deletes
    it mid-restore), under this holder name; ``background_rate``: the cap, in bytes per
    second, of a background (standby) prefetch."""

    concurrency: int = 2
    expected_nodes: tuple[str, ...] = ()
    pin_holder: str | None = None
    background_rate: float | None = None


@dataclass(frozen=True)
class PrefetchLinks:
    """What a prefetcher works with besides its hot dir and tiers: ``chunk_source``, the
    peers a restore asks before the store; ``fanout_client``, how it asks a fan-out's
    members for their shares; ``on_restore``, told before a step is restored here (the push
    queue must never push it back as this node's part); ``holds``, the steps in use that hot
    retention leaves alone; ``spawn``, what starts each job's task (in the agent, its
    services' group); ``own_part``, told (job, step, its directory, its files) before a
    prefetch adds to this node's own part of a step, the step or a share of it: the push
    queue goes on pushing those files alone to every tier that lacks them (the directory
    is no longer all this node's own, nor, with a share, a save); ``step_changed``, told
    (job, step) once a prefetch of it ended, whatever the outcome: the step's directory
    may hold files it did not (the index of what this node serves its peers reads it
    again)."""

    chunk_source: ChunkSource | None = None
    fanout_client: PeerSource | None = None
    on_restore: Callable[[str, int], None] | None = None
    holds: StepHolds | None = None
    spawn: Spawn = own_task
    own_part: Callable[[str, int, Path, frozenset[str]], None] | None = None
    step_changed: Callable[[str, int], None] | None = None


class Prefetcher:
    """Owns every prefetch job and its task; at most ``concurrency`` run at once."""

    #: finished prefetches kept for GET /v1/prefetch/{id} (the oldest are forgotten)
    HISTORY = 1000

    def __init__(
        self,
        hot_dir: HotDir,
        tiers: list[tuple[str, Store]],
        options: TransferOptions,
        meter: BandwidthMeter,
        policy: PrefetchPolicy | None = None,
        links: PrefetchLinks | None = None,
    ) -> None:
        policy, links = policy or PrefetchPolicy(), links or PrefetchLinks()
        concurrency, expected_nodes = policy.concurrency, policy.expected_nodes
        pin_holder, background_rate = policy.pin_holder, policy.background_rate
        chunk_source, fanout_client, on_restore = (
            links.chunk_source,
            links.fanout_client,
            links.on_restore,
        )
        holds, spawn = links.holds, links.spawn
        self.own_part, self.step_changed = links.own_part, links.step_changed
        self.expected_nodes = expected_nodes
        #: starts each job's task (in the agent: its services' group, which awaits them all)
        self.spawn = spawn
        #: asks the members of a fan-out restore (agent/peers/fanout.py) for their shares
        self.fanout_client = fanout_client
        #: chunks of the restores running here, as they land: the chunk route serves them
        self.landing = Landing()
        #: the cap on a background (standby) prefetch's bytes per second
        self.background_limit = RateLimit(background_rate) if background_rate else None
        #: what each restore made here looked like once verified (sizes, mtimes, inodes): a
        #: later prefetch of it that finds it unchanged need not re-hash it
        self._restored: dict[tuple[str, int], tuple[list[SourceFile], bool]] = {}
        #: steps this prefetch writes or reads as a base: hot retention leaves them alone
        self.holds = holds or StepHolds()
        #: when set, the step is pinned in the tier's store while it is pulled from there,
        #: so no node's retention deletes it mid-restore
        self.pin_holder = pin_holder
        self.chunk_source = chunk_source
        # a restored checkpoint lands in the hot dir like a training save; the push queue
        # must not push it back as this node's part
        self.on_restore = on_restore
        self.hot_dir = hot_dir
        self.tiers = tiers
        self.options = options
        self.meter = meter
        self.jobs: dict[str, PrefetchJob] = {}
        #: what every finished prefetch took and moved per source, this agent's life long
        #: (GET /metrics: counters, which must not drop when a record is forgotten)
        self.finished_seconds = 0.0
        self.finished_bytes: dict[str, int] = {}
        self._finished: collections.deque[str] = collections.deque()  # ids, oldest first
        self.swept = self._sweep()
        self._slots = asyncio.Semaphore(concurrency)
        self._dest_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._disk_probe = asyncio.Lock()

    async def measure_disk(self) -> None:
        """The hot dir's write rate, as a restore here writes (writeprobe.py), into the
        meter as ``disk``: probed once, at the agent's start or at an estimate's first
        contact, whichever asks first; every restore then re-measures it (``_restore``).
        ``auto`` probes both ways, up to WRITE_PROBE_ROUNDS times each, in turn (each
        direct round read back too: warm's read-back is disk work), and chooses by the
        best rate of each (other work only slows a probe); the estimate takes the median
        round. A probe that fails is logged, and the default rate stands."""
        async with self._disk_probe:
            if self.meter.measured("disk"):
                return
            chosen = self.options.write_path
            ways = (True, False) if chosen == "auto" else (chosen != "buffered",)
            samples: dict[bool, list[DiskProbe]] = {way: [] for way in ways}
            try:
                size = await asyncio.to_thread(probe_size, self.hot_dir.root)
                if not size:  # (a nearly full disk: training's saves need the room)
                    log.warning("too little free space in %s to probe its write rate: the "
                                "default rate stands", self.hot_dir.root)  # fmt: skip
                    return
                began = time.monotonic()
                for _ in range(WRITE_PROBE_ROUNDS):
                    for direct in ways:
                        got = await self._probe(size, direct=direct, read_back=chosen == "auto")
                        samples[direct].append(got)
                    if time.monotonic() - began >= WRITE_PROBE_BUDGET_SECONDS:
                        break
            except (OSError, FerryError) as exc:  # (a full disk: DestinationError)
                log.warning("could not probe the write rate of %s: %s", self.hot_dir.root, exc)
                return
            best = {way: max(got, key=_rate) for way, got in samples.items()}
            typical = {way: sorted(got, key=_rate)[len(got) // 2] for way, got in samples.items()}
            direct_rate = _rate(best[ways[0]])
            buffered_rate = read_rate = None
            if chosen == "auto":  # buffered only where the page cache is the cheaper way
                buffered_rate = _rate(best[False])
                read_rate = _read_rate(samples[True])
                first = page_cache_first(direct_rate, buffered_rate, read_rate)
                self.options = dataclasses.replace(self.options, page_cache_first=first)
            # the estimate's disk: the way restores that fit will write (the rest go direct);
            # its median round, not its best (the best decides the way, not what to expect)
            way = typical[False] if self.options.page_cache_first else typical[ways[0]]
            self.meter.record("disk", way.written, way.busy_seconds, provisional=True)
            event(log, "write_probe", rate_direct=round(direct_rate),
                  rate_buffered=buffered_rate and round(buffered_rate),
                  rate_read=read_rate and round(read_rate),
                  rate_warm=read_rate and round(warm_rate(direct_rate, read_rate)),
                  rate_expected=round(_rate(way)),
                  write_path=self.options.write_path,
                  chose=("buffered" if self.options.page_cache_first else "warm")
                  if chosen == "auto" else chosen,
                  page_cache_first=self.options.page_cache_first,
                  rounds=len(samples[ways[0]]),
                  each_mbps={("direct" if way else "buffered"): [round(_rate(x) / 1e6) for x in got]
                             for way, got in samples.items()})  # fmt: skip
            if buffered_rate is not None:  # for a one-shot `ferry pull` into this disk
                # (a thread of its own, not awaited: a hung home directory must not hold up
                # the probe, nor the agent's stop)
                threading.Thread(
                    target=self._leave_choice, name="ferry-probe-record", daemon=True,
                    args=(self.options.page_cache_first, direct_rate, buffered_rate, read_rate),
                ).start()  # fmt: skip

    def _leave_choice(
        self, first: bool, direct_rate: float, buffered_rate: float, read_rate: float | None
    ) -> None:
        """What the probe chose, for a one-shot `ferry pull` into this disk (writechoice.py);
        a state dir that cannot be written (a read-only root in a container) only costs the
        CLI its choice."""
        try:
            record_choice(self.hot_dir.root, first, direct_rate, buffered_rate, read_rate=read_rate)
        except (OSError, ValueError, RuntimeError) as exc:
            log.info("the write probe's choice is not left for the CLI: %s", exc)

    async def _probe(self, nbytes: int, *, direct: bool, read_back: bool) -> DiskProbe:
        return await asyncio.to_thread(
            probe_write,
            self.hot_dir.root, direct=direct, workers=self.options.workers, nbytes=nbytes,
            read_back=read_back and direct,
        )  # fmt: skip

    def _sweep(self) -> list[Path]:
        """Staging dirs of prefetches a killed agent left behind (none can be running yet),
        and restores made before a reboot that never reached the disk (settle.py)."""
        jobs = [self.hot_dir.job_path(job) for job in self.hot_dir.jobs()]
        for d in jobs:
            for found in settle(d):  # (not read back here: removed, to be fetched again)
                log.warning("removed %s: restored %s", found.dest, found.why)
        return [gone for d in jobs for gone in sweep_stale_staging(d)]

    def submit(
        self,
        job: str,
        step: int | None,
        deadline_s: float | None,
        *,
        background: bool = False,
        fanout: tuple[tuple[str, ...], str] | None = None,
        layout: dict[str, Any] | None = None,
        items: list[Any] | None = None,
        fanout_layouts: dict[str, dict[str, Any]] | None = None,
    ) -> PrefetchJob:
        record = PrefetchJob(
            secrets.token_hex(8), job, step, deadline_s, background=background, fanout=fanout,
            layout=layout, items=items, fanout_layouts=fanout_layouts or {},
        )  # fmt: skip
        if fanout is not None:
            self.landing.begin()  # ended when the job ends (_run)
        self._forget_oldest_finished()
        self.jobs[record.id] = record
        record.task = self.spawn(self._run(record), name=f"prefetch-{record.id}")
        return record

    def _forget_oldest_finished(self) -> None:
        """Keep at most HISTORY finished prefetches (GET /v1/prefetch/{id} of an older one
        is a 404), the destination locks of running ones only, and what a restore looked
        like only while its directory is still here (hot retention evicts it): a daemon
        that serves prefetches and standby replications for months must not grow with
        them (docs/RELIABILITY.md, "Bounded state")."""
        while len(self._finished) > self.HISTORY:
            self.jobs.pop(self._finished.popleft(), None)
        active = {(r.job, r.step) for r in self.jobs.values() if r.state not in FINAL}
        for key in [k for k in self._dest_locks if k not in active]:
            del self._dest_locks[key]
        for job, step in [k for k in self._restored if not self.hot_dir.step_path(*k).is_dir()]:
            del self._restored[(job, step)]

    def bytes_moved(self) -> dict[str, int]:
        """Bytes prefetched per source over this agent's life: the finished prefetches'
        and the running ones' so far (never less than an earlier answer)."""
        moved = dict(self.finished_bytes)
        for record in self.jobs.values():
            if record.state not in FINAL:
                for source, nbytes in record.bytes_by_source.items():
                    moved[source] = moved.get(source, 0) + nbytes
        return moved

    def cancel(self, job_id: str) -> PrefetchJob | None:
        record = self.jobs.get(job_id)
        if record is not None and record.task is not None and record.state not in FINAL:
            record.discard_partial = True
            record.task.cancel()
        return record

    def active(self) -> int:
        return sum(1 for j in self.jobs.values() if j.state not in FINAL)

    async def drain(self, seconds: float) -> None:
        """Let running jobs finish for up to ``seconds``, then cancel the rest."""
        await drain_tasks([j.task for j in self.jobs.values() if j.task], seconds)

    async def _run(self, record: PrefetchJob) -> None:
        try:
            began = time.time()
            if await self._intact_here(record):  # (nothing to move: no slot to wait for)
                record.state, record.started = State.READY, began
            else:
                async with self._slots:
                    record.state, record.started = State.RUNNING, time.time()
                    async with asyncio.timeout(record.deadline_s):
                        await self._fetch(record)
                    record.state = State.READY
        except asyncio.CancelledError:
            record.state, record.error = State.CANCELLED, "cancelled"
            if record.discard_partial and record.dest is not None:
                await asyncio.to_thread(discard_leftovers, Path(record.dest))
        except TimeoutError:
            record.state, record.error = State.FAILED, f"deadline of {record.deadline_s}s passed"
            record.error_type = "Timeout"
        except FerryError as exc:
            record.state, record.error = State.FAILED, " ".join(str(exc).split())
            record.error_type = type(exc).__name__
        except (OSError, ValueError) as exc:  # not one of ours: keep the trace for the log
            log.warning("prefetch %s failed", record.id, exc_info=True)
            text = " ".join(str(exc).split())
            record.state, record.error = State.FAILED, f"{type(exc).__name__}: {text}"
            record.error_type = type(exc).__name__
        except Exception as exc:  # a bug: the record still ends (a scheduler polling it
            # would wait for good), and the trace is in the log to report
            log.error("prefetch %s failed on a bug", record.id, exc_info=True)
            text = " ".join(str(exc).split())
            bug = f"{type(exc).__name__}: {text}"
            record.state, record.error = State.FAILED, f"internal error (a bug): {bug}"
            record.error_type = "InternalError"
        finally:
            if record.fanout is not None:
                self.landing.end()
            record.finished = time.time()
            self.finished_seconds += record.finished - (record.started or record.finished)
            for source, nbytes in record.bytes_by_source.items():
                self.finished_bytes[source] = self.finished_bytes.get(source, 0) + nbytes
            self._finished.append(record.id)
            self._forget_oldest_finished()
            record.ended.set()
            if self.step_changed is not None and record.step is not None:
                self.step_changed(record.job, record.step)
            if record.state is State.READY and record.started is not None:
                took = record.finished - record.started
                kind = "check" if record.satisfied_by in ("held", "replica") else "restore"
                self.meter.record_start(kind, max(0.0, took - record.moving_seconds))
            event(log, "prefetch", level=logging.INFO if record.state is State.READY
                  else logging.WARNING, id=record.id, job=record.job, step=record.step,
                  outcome=record.state.value,
                  seconds=round(record.finished - (record.started or record.finished), 3),
                  bytes=sum(record.bytes_by_source.values()),
                  **{f"bytes_{k}": v for k, v in record.bytes_by_source.items()},
                  error=record.error)  # fmt: skip
        if record.state is State.READY:  # once the scheduler has its answer:
            await asyncio.to_thread(self._warm_held, record)  # the load is coming
            await asyncio.to_thread(self._settle, record)  # flush what was restored

    def _warm_held(self, record: PrefetchJob) -> None:
        """A step that was here already (a standby's replica, an earlier restore, training's
        own save) is most likely not in the page cache: ask the kernel to read it in now,
        ahead of the load the scheduler starts next, if it fits in spare memory and the
        write path leaves restores in memory (warmcache.py). A restore warmed itself."""
        if record.background or record.satisfied_by not in ("held", "replica"):
            return
        if self.options.write_path == "direct" or record.dest is None:
            return
        files = warmcache.tree_files(Path(record.dest))
        if fits_in_spare_memory(warmcache.allocated_bytes(files)):
            warmcache.warm_files(files)

    def _settle(self, record: PrefetchJob) -> None:
        try:
            settle(self.hot_dir.job_path(record.job))
        except OSError as exc:  # retried at the next prefetch or start
            log.warning("could not flush the restore of %s: %s", record.job, exc)

    async def _fetch(self, record: PrefetchJob) -> None:
        """Tiers in order: one that lacks the checkpoint, or fails while serving it (store
        error, corrupt chunk), hands over to the next."""
        errors: list[str] = []
        absent: list[bool] = []  # per tier: it just did not hold the checkpoint
        requested = record.step
        for name, store in self.tiers:
            try:
                await self._from_tier(record, name, store, requested)
                return
            except (
                CheckpointNotFoundError,
                IncompleteStepError,
                StoreError,
                IntegrityError,
            ) as exc:
                # (IncompleteStepError: every part here, a file still missing from them: a torn
                # part; the next tier may hold the step whole)
                errors.append(f"{name}: {' '.join(str(exc).split())}")
                absent.append(isinstance(exc, CheckpointNotFoundError))
                record.bytes_done = 0
        if all(absent):  # (errors decide, never their text)
            raise CheckpointNotFoundError(await self._not_held(record.job, requested, errors))
        raise FerryError("; ".join(errors))

    async def _not_held(self, job: str, step: int | None, errors: list[str]) -> str:
        """No tier holds it: each tier's reason naming what it holds instead (the steps or
        jobs there: a typo'd step or job is seen at once; one listing per tier, on this
        path only), else as the tier said it."""
        said = []
        for (name, store), error in zip(self.tiers, errors, strict=True):
            try:
                instead = await missing(store, job, step)
            except FerryError:
                instead = None
            said.append(f"{name}: {' '.join(str(instead).split())}" if instead else error)
        return "; ".join(said) or "no tiers configured"

    async def _intact_here(self, record: PrefetchJob) -> bool:
        """Whether ``record`` asks by number for a whole step this agent restored here and
        no file of which changed since (a standby's replica, an earlier prefetch): then it
        is ready without a request to any tier, as a committed step never changes and the
        copy was verified when it was restored (the standby's wait: the store's marker,
        manifests and pin were ~0.03 s of it on loopback, more over a real link). So a step
        deleted from the tiers since (expired, or removed by hand) is still served from
        here: to withdraw one from a node, delete it from the hot dir."""
        if record.step is None or record.fanout is not None:
            return False
        if record.layout is not None or record.items is not None:
            return False  # (a share: the pull plans what it needs of the step)
        here = self.hot_dir.step_path(record.job, record.step)
        try:
            how = await self.intact_restore(record.job, record.step, here)
        except (FerryError, OSError):  # (evicted meanwhile: the long way restores it)
            return False
        if how is None:
            return False
        record.dest, record.satisfied_by = str(here), how
        return True

    async def _from_tier(
        self, record: PrefetchJob, name: str, store: Store, requested: int | None
    ) -> None:
        """The prefetch from one tier; once more reading the parts themselves when a chunk
        the step's common index supplied is missing or wrong there. When that read works,
        the index was stale (a repack by an agent that predates it re-pointed a part this
        reader did not read: format/stepcommon.py) and is dropped from the marker; when it
        fails too, the store lost the chunk, and that failure is the tier's, as any other."""
        record.index_ok = record.use_index
        try:
            await self._attempt(record, name, store, requested)
        except IntegrityError as exc:  # (a pack gone, or not what it names: IntegrityError)
            if not set(exc.bad_chunks) & record.index_chunks:
                raise
            record.index_ok, record.bytes_done = False, 0
            await self._attempt(record, name, store, requested)
            log.warning("%s: %s, where the step's common index put it, but not where its part "
                        "does: the index was stale (a repack by an older agent?); dropped",
                        name, exc)  # fmt: skip
            if record.step is not None:  # so that no later reader tries it first
                with contextlib.suppress(FerryError):  # (a tier this agent may not write)
                    await drop_common_index(store, record.job, record.step)

    async def _attempt(
        self, record: PrefetchJob, name: str, store: Store, requested: int | None
    ) -> None:
        record.index_chunks = frozenset()
        manifests = await self._resolve(record, store, requested)
        record.step = manifests[0].step
        record.index_chunks = index_chunks(manifests)
        lock = self._dest_locks.setdefault((record.job, record.step), asyncio.Lock())
        async with lock, self._store_pin(store, record):
            # (the lock: two prefetches of one checkpoint never race on its dir)
            await self._pull_from(record, name, store, manifests)

    async def _resolve(
        self, record: PrefetchJob, store: Store, requested: int | None
    ) -> list[Manifest]:
        """The step's manifests; for a share asked of a step with nothing of it here (a
        survivor after a scale-down), only the parts the share touches, the share planned
        with them (record.planned): a few manifests of an N-node step, not N. A fan-out
        member's share too, with every member's share planned from ``.metadata`` beside
        it (record.group_shares: the owners by position, _fanout_source)."""
        record.planned = record.group_shares = None
        if record.layout is None and record.items is None:
            return await resolve_checkpoint(store, record.job, requested, self.expected_nodes)
        layout = None if record.layout is None else _layout_of(record.layout)
        # a fan-out member plans every member's share too, from .metadata, with its own
        me = None if record.fanout is None else record.fanout[1]
        asks: dict[str | None, tuple[Layout | None, object]] = {
            url: (_layout_of(v), None) for url, v in record.fanout_layouts.items()
        }
        asks[me] = (layout, record.items)  # (its own request's, whatever the map said)
        manifests, shares = await resolve_shares(
            store, record.job, requested, self.expected_nodes, asks, me, record.index_ok
        )
        record.step, record.planned = manifests[0].step, shares.pop(me)
        if me is not None:  # (its own: what its pull writes, _fanout_source)
            record.group_shares = {url: v for url, v in shares.items() if url is not None}
        if self._share_copy_here(record.job, manifests[0].step):
            # what a partial copy here holds may reach into any part
            return await self._every_part(record, store)
        return manifests

    async def _every_part(self, record: PrefetchJob, store: Store) -> list[Manifest]:
        """Every part of the step, for a prefetch resolved from only its share's parts
        that turns out to need them all (the share is planned again from them)."""
        assert record.step is not None
        record.planned = None
        return await resolve_manifests(store, record.job, record.step)

    def _share_copy_here(self, job: str, step: int) -> bool:
        return self.hot_dir.is_share(self.hot_dir.step_path(job, step))

    @contextlib.asynccontextmanager
    async def _store_pin(self, store: Store, record: PrefetchJob) -> AsyncIterator[None]:
        """Pin the step in ``store`` for the restore (best effort: a store that refuses the
        pin will most likely refuse the reads too, and say so more usefully)."""
        assert record.step is not None
        if self.pin_holder is None:
            yield
            return
        ttl = min(record.deadline_s or PREFETCH_PIN_SECONDS, PREFETCH_PIN_SECONDS)
        try:
            await pin(store, record.job, record.step, self.pin_holder, ttl)
        except FerryError as exc:
            log.warning(
                "could not pin %s step %s in %s: %s", record.job, record.step, store.url, exc
            )
        try:
            yield
        finally:
            try:
                await unpin(store, record.job, record.step, self.pin_holder)
            except FerryError as exc:  # it expires on its own
                log.warning("could not unpin %s step %s: %s", record.job, record.step, exc)

    async def _fill_in(
        self, record: PrefetchJob, name: str, store: Store, here: Path, manifests: list[Manifest]
    ) -> None:
        """Complete a step directory that holds only some parts: pull the whole checkpoint
        beside it (reusing its verified chunks), then move in only the files it lacks; files
        it has are never touched."""
        assert record.step is not None
        files = merged_files(manifests)  # once: checked here, restored, then moved in
        for entry in files:  # fail before downloading anything
            path_in_step_dir(here, entry.path)
        await self._keep_own_part(record, here)
        scratch = staging_path(here, "fill-")
        try:
            plan = PullPlan(record.job, record.step, manifests=manifests, files=files)
            await self._restore(record, name, store, plan, scratch, base=here)
            await asyncio.to_thread(_move_missing, scratch, here, files)
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)

    async def _pull_from(
        self, record: PrefetchJob, name: str, store: Store, manifests: list[Manifest]
    ) -> None:
        assert record.step is not None
        dest = self.hot_dir.step_path(record.job, record.step)
        record.dest = str(dest)
        if record.planned is not None and self._share_copy_here(record.job, record.step):
            # another prefetch put a copy there since this one resolved the step
            manifests = await self._every_part(record, store)
        held = self.hot_dir.checkpoints(record.job)
        to_share = record.layout is not None or record.items is not None
        to_share = to_share or self.hot_dir.is_share(dest)
        base = self._base(record, held, to_share)
        # held from the listing on, with no await in between: hot retention checks the holds
        # just before it takes a step away (hotretention.apply_hot), so neither the step
        # found here nor the base chosen is evicted under this prefetch
        with self.holds.hold((record.job, record.step), (record.job, base.step) if base else None):
            await self._pull_here(record, name, store, manifests, held, base, to_share)

    def _base(
        self, record: PrefetchJob, held: list[LocalCheckpoint], to_share: bool
    ) -> LocalCheckpoint | None:
        """The checkpoint a restore starts from: the newest older whole one here; for a
        share (or into a partial copy), a partial copy counts too."""
        assert record.step is not None
        older = [c for c in held if c.step < record.step]
        if to_share:
            shares = self.hot_dir.shares()
            older += [c for c in shares if c.job == record.job and c.step < record.step]
        return max(older, key=lambda c: c.step, default=None)

    async def _pull_here(
        self,
        record: PrefetchJob,
        name: str,
        store: Store,
        manifests: list[Manifest],
        held: list[LocalCheckpoint],
        base: LocalCheckpoint | None,
        to_share: bool,
    ) -> None:
        assert record.step is not None and record.dest is not None
        dest = Path(record.dest)
        here = next((c for c in held if c.step == record.step), None)
        if here is not None:
            # already here (written by training on this node, or an earlier prefetch):
            # ready only if it is an exact copy; it is never overwritten
            record.dest = str(here.path)
            if (how := await self.intact_restore(record.job, record.step, here.path)) is not None:
                record.satisfied_by = how  # restored here, verified, untouched since
                return
            began = time.monotonic()
            problems = await local_copy_differences(here.path, manifests)
            record.moving_seconds += time.monotonic() - began
            if not problems:  # a whole re-hash: what the estimate of a held step is made of
                held_bytes = sum(f.size for m in manifests for f in m.files)
                self.meter.record("local", held_bytes, time.monotonic() - began)
            if any(not p.endswith(": missing") for p in problems):
                raise DestinationError(
                    f"{here.path} exists and is not the committed checkpoint "
                    f"({'; '.join(problems[:3])}); it is never overwritten"
                )
            if problems and to_share:  # this node's own part: add only what the share lacks
                # (in a fan-out group the others may count on this one for chunks of its
                # part, which it serves from the part: _land_own while this runs, then the
                # peers' index, agent/peers/chunks.py HotIndex)
                base_dir = base.path if base is not None else None
                how = await self._add_share(record, name, store, manifests, here.path, base_dir)
                record.satisfied_by = how
                return
            if problems:  # this node's own part of a multi-node step: add the other parts
                if record.planned is not None:  # (resolved for a share: only some parts)
                    manifests = await self._every_part(record, store)
                await self._fill_in(record, name, store, here.path, manifests)
            record.satisfied_by = "filled_in" if problems else "held"
            return
        base_dir = base.path if base is not None else None
        if to_share:
            await self._pull_share(record, name, store, manifests, base_dir)
            return
        # (the base's manifests: the pull reads them by its directory's name, once)
        plan = PullPlan(record.job, record.step, manifests=manifests)
        await self._restore(record, name, store, plan, dest, base_dir)
        record.satisfied_by = "restored"
        files = await asyncio.to_thread(scan_checkpoint, dest)
        self._restored[(record.job, record.step)] = (files, record.background)

    async def _keep_own_part(self, record: PrefetchJob, here: Path) -> None:
        """Tell the push queue which files of ``here`` are this node's own part (all it
        holds, checked against the step: nothing was added yet), before anything is: its
        push goes on with them alone."""
        assert record.step is not None
        if self.own_part is None:
            return
        files = await asyncio.to_thread(scan_checkpoint, here)
        self.own_part(record.job, record.step, here, frozenset(f.path for f in files))

    def _land_own(self, record: PrefetchJob, here: Path, files: list[FileEntry]) -> list[str]:
        """For a fan-out member adding its share to its own part: the chunks of its own
        ``files`` (verified just now), landed where they are for the members asking for
        them; the ids to release once the restore ends (none outside a group)."""
        if record.fanout is None:
            return []
        where = {
            c.id: (path_in_step_dir(here, f.path), at, c.size)
            for f in files
            for at, c in f.chunk_offsets()
        }
        self.landing.expect(where)
        for cid, location in where.items():
            self.landing.land(cid, location)
        return list(where)

    async def _add_share(
        self,
        record: PrefetchJob,
        name: str,
        store: Store,
        manifests: list[Manifest],
        here: Path,
        base: Path | None,
    ) -> str:
        """Into this node's own part of the step (``here``, its files just verified), only
        what the share asks that the part lacks, moved in beside its files, which are never
        touched: a survivor of a scale-down receives its share, not the step. From its
        first write the copy is a partial copy (its record names its own files, then the
        share too): never pushed as a save (its own files go on alone: _keep_own_part),
        served to a peer as the step, or taken for it. "held": the part holds all the
        share asks already."""
        assert record.step is not None
        job, step, share = record.job, record.step, record.planned
        if share is None:  # (resolved from every part: no file map)
            layout = None if record.layout is None else _layout_of(record.layout)
            share = await plan_share(Catalog(store), manifests, layout, record.items)
        files = merged_files(manifests)
        paths = {f.path for f in files} | share.storage
        sizes = await asyncio.to_thread(_sizes_here, here, paths)
        lacking = [f for f in files if f.path not in sizes and share.spans_of(f.path) != ()]
        if not lacking:
            return "held"
        await self._keep_own_part(record, here)
        # every storage file the part holds, read by the share or not: a later, wider ask
        # rebuilds the copy from its record (plan_fill, widen) and must keep them all
        own: Ranges = {p: ((0, n),) for p, n in sizes.items() if p in share.storage and n}
        await asyncio.to_thread(replace_record, here, job, step, Share(own, share.storage, None))
        wanted = {f.path for f in lacking}
        asked = {path: spans for path, spans in share.ranges.items() if path in wanted}
        scratch = staging_path(here, "fill-")
        # in a fan-out group the others may count on this member for its own part's chunks
        # (they plan its share from its layout): served from the part while this runs
        own_chunks = self._land_own(record, here, [f for f in files if f.path in sizes])
        try:
            narrowed = Share(asked, share.storage, share.layout)
            plan = PullPlan(job, step, manifests=manifests, files=lacking, share=narrowed)
            # durable before it is moved in: the record about to name it is (settle.py
            # flushes only restores renamed into place, not files moved from scratch)
            plan = dataclasses.replace(plan, fsync=True)
            await self._restore(record, name, store, plan, scratch, base)
            await asyncio.to_thread(_move_missing, scratch, here, lacking)
        finally:
            self.landing.release(own_chunks)
            await asyncio.to_thread(shutil.rmtree, scratch, True)
        both = merge_ranges(
            (path, lo, hi - lo)
            for ranges in (own, share.ranges)
            for path, spans in ranges.items()
            for lo, hi in spans
        )
        await asyncio.to_thread(
            replace_record, here, job, step, Share(both, share.storage, share.layout)
        )
        return "filled_in"

    async def _pull_share(
        self,
        record: PrefetchJob,
        name: str,
        store: Store,
        manifests: list[Manifest],
        base: Path | None,
    ) -> None:
        """A share of the step (record.layout or record.items), or the whole step where a
        share copy is (record asks for neither): a copy already holding what is asked is
        ready ("held"); one holding less is completed in place: what is asked and what it
        holds is pulled beside it, reusing its verified chunks, and swapped in."""
        assert record.step is not None and record.dest is not None
        dest = Path(record.dest)
        layout = None if record.layout is None else _layout_of(record.layout)
        todo = await plan_fill(
            Catalog(store), manifests, dest, layout, record.items, record.planned
        )
        if todo.held:
            record.satisfied_by = "held"
            return
        plan = PullPlan(record.job, record.step, manifests=manifests, share=todo.share)
        if not todo.fill:  # from nothing, from its base
            await self._restore(record, name, store, plan, dest, base)
            record.satisfied_by = "restored"
            return
        scratch = staging_path(dest, "fill-")
        try:
            plan = dataclasses.replace(plan, fsync=True)
            await self._restore(record, name, store, plan, scratch, dest)
            await asyncio.to_thread(_swap_in, scratch, dest)
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)
        record.satisfied_by = "filled_in"

    async def intact_restore(self, job: str, step: int, here: Path) -> str | None:
        """ "replica" or "held" when this agent restored ``here`` (verified) and no file of
        it changed since (size, mtime, inode); None: check it the long way. Only the look
        at the files runs on a thread: ``_restored`` is the loop's alone (prefetches of one
        step asked at once check it at once: two forgetting it from their threads raised
        KeyError in the second, whose record stayed queued for good). The estimate asks it
        too: such a step is ready at the cost of a stat, not of a re-hash."""
        key = (job, step)
        made = self._restored.get(key)
        if made is None:
            return None
        files, background = made
        try:
            await asyncio.to_thread(check_unchanged, here, files)
        except SourceChangedError:
            if self._restored.get(key) is made:  # (not a newer restore's, made meanwhile)
                del self._restored[key]
            return None
        return "replica" if background else "held"

    def _measured_disk(self, written: int, busy: float, took: float) -> None:
        """The disk this restore wrote to, as fast as it took the bytes (``_disk_sample``)."""
        rate = write_rate(written, busy)
        if _disk_sample(rate, busy, took, self.meter.rate("disk")):
            self.meter.record("disk", written, busy)

    async def _base_parts(
        self, record: PrefetchJob, store: Store, plan: PullPlan, base: Path | None
    ) -> list[Manifest] | None:
        """For a share resolved from only the parts it touches, the base step's parts
        holding the same files (share.base_dir_parts); else None: the pull reads them all."""
        if record.planned is None or plan.manifests is None:
            return None
        return await base_dir_parts(store, record.job, plan.manifests, base, record.index_ok)

    def is_replica(self, job: str, step: int) -> bool:
        """Whether a standby's replication put ``step`` here (this agent's run)."""
        return self._restored.get((job, step), ([], False))[1]

    async def _restore(
        self,
        record: PrefetchJob,
        name: str,
        store: Store,
        plan: PullPlan,
        dest: Path,
        base: Path | None,
    ) -> None:
        """Pull ``plan``'s checkpoint (or its share) into ``dest`` (its manifests resolved
        once, by _fetch: not read again; ``base``, then peers, then this tier) and record
        what moved from where; the tier's measured bandwidth feeds later estimates."""
        assert record.step is not None and plan.manifests is not None
        if self.on_restore is not None:
            self.on_restore(record.job, record.step)
        source = f"tier:{name}"
        record.bytes_by_source.setdefault(source, 0)  # named even when it sends nothing
        record.eta_rate = self.meter.rate(source)
        peers = await self._peers_for(plan.manifests)
        base_parts = await self._base_parts(record, store, plan, base)
        sources = Sources(base, base_parts, peers)
        # what this restore will land here: members asking for it are held until it does
        wanted: list[str] = []
        if record.fanout is not None and self.fanout_client is not None:
            fan, wanted, plan = await self._fanout_source(record, store, plan)
            await fan.probe()
            sources = Sources(
                base, base_parts, chain=(fan,), store_first=fan.mine, ask_first=fan.held
            )
        began = time.monotonic()
        self.landing.expect(wanted)
        rate_limit = self.background_limit if record.background else None
        events = PullEvents(
            _JobProgress(record), self.landing.land, functools.partial(_count_moved, record, source)
        )
        options = self.options
        if record.background and options.write_path in ("auto", "warm"):  # no load is
            options = dataclasses.replace(options, write_path="direct")  # coming yet
        try:
            plan = dataclasses.replace(plan, rate_limit=rate_limit)
            result = await pull(store, dest, plan, sources, events, options)
        finally:
            self.landing.release(wanted)
        # the rate of whichever source moved most of it: a peer-served restore timed as the
        # tier's would make the tier look as slow as the few bytes it sent
        took = time.monotonic() - began
        record.moving_seconds += took
        if result.bytes_from_source > result.bytes_transferred:  # (with a base here the
            # peers sent deltas against it: timed apart, estimate.PEER_DELTAS)
            self.meter.record(peer_key(base is not None), result.bytes_from_source, took)
        else:
            self.meter.record(source, result.bytes_transferred, took)
        self._measured_disk(result.bytes_written, result.write_busy_seconds, took)
        # bytes_by_source / bytes_by_peer were counted live by _count_moved
        record.chunks_local = result.chunks_local
        record.chunks_resumed = result.chunks_resumed

    async def _peers_for(self, manifests: list[Manifest]) -> tuple[ChunkSource, ...]:
        """The chunk source of a restore from the peers: each chunk asked first of the peer
        whose node's part holds it (the step's manifests say whose; the peers' /healthz
        which node each is), then the others in turn."""
        source = self.chunk_source
        if source is None:
            return ()
        if not isinstance(source, PeerSource):
            return (source,)
        return (await source.for_step(manifests),)

    async def _fanout_source(
        self, record: PrefetchJob, store: Store, plan: PullPlan
    ) -> tuple[FanoutSource, list[str], PullPlan]:
        """A fan-out member's chunk source, the chunks it will land (members asking for one
        are held until it does: all-zero chunks are never fetched) and the plan, its files
        merged once. With members' layouts: every member's share (planned when the step
        was resolved, else from ``.metadata`` now) and where this member writes each
        chunk, for owners by position (fanout.position_owners)."""
        assert record.fanout is not None and self.fanout_client is not None
        assert plan.manifests is not None
        manifests = plan.manifests
        files = plan.files
        if files is None:  # merged once, for the positions and for the pull
            files = await asyncio.to_thread(merged_files, manifests)
            plan = dataclasses.replace(plan, files=files)
        positions = await asyncio.to_thread(chunk_positions, files, plan.share)
        holders = file_holders(manifests)  # (a chunk another member holds: asked of it first)
        if not record.fanout_layouts:  # every member wants the step: owners by chunk id
            fan = FanoutSource(
                self.fanout_client, *record.fanout, positions=positions, holders=holders
            )
            return fan, list(positions), plan
        me = record.fanout[1]
        others = record.group_shares
        if others is None:  # resolved from every part: a whole-step member
            asks = {url: (_layout_of(v), None) for url, v in record.fanout_layouts.items()}
            asks.pop(me, None)
            others = dict(await plan_shares(Catalog(store), manifests, asks))
        shares = {**others, me: plan.share}  # (its own: what this pull writes; None: all)
        fan = FanoutSource(self.fanout_client, *record.fanout, shares, positions, holders)
        return fan, list(positions), plan


def _rate(sample: DiskProbe) -> float:
    """Bytes per second of a write probe's round."""
    return sample.written / max(sample.busy_seconds, 1e-9)


def _read_rate(rounds: list[DiskProbe]) -> float | None:
    """The best rate the probe's rounds read their bytes back at (None: none was)."""
    rates = [r.written / max(r.read_seconds, 1e-9) for r in rounds if r.read_seconds is not None]
    return max(rates, default=None)


#: a restore whose writes were in progress this much of its time was held back by its disk
DISK_BOUND = 0.8


def _disk_sample(rate: float | None, busy: float, took: float, current: float) -> bool:
    """Whether a restore's write ``rate`` (``busy`` of its ``took`` seconds writing) is a
    sample of the disk's: when the disk set the pace, yes; when it kept up (idle between
    writes, a source or the CPU the limit), the disk is at least that fast, which says
    something only when that is faster than the rate the meter has. A CPU-bound restore
    on a busy machine, whose writers wait for a core mid-write, never drags the disk's
    rate down to its own pace."""
    if rate is None:
        return False
    return busy >= DISK_BOUND * took or rate > current


def _layout_of(doc: dict[str, Any]) -> Layout:
    """A request's layout (``{"world_size", "ranks"}``, shaped by middleware.parse_layout)
    as the share planner's Layout, which says whether the ranks fit the world."""
    return Layout(doc["world_size"], tuple(doc["ranks"]))


def _count_moved(record: PrefetchJob, tier: str, origin: str, n: int) -> None:
    """Live bytes per source: ``store`` is this tier's; ``peer:<url>`` a peer agent's."""
    if origin.startswith("peer:"):
        url = origin.removeprefix("peer:")
        record.bytes_by_peer[url] = record.bytes_by_peer.get(url, 0) + n
        origin = "peer"
    elif origin == "store":
        origin = tier
    record.bytes_by_source[origin] = record.bytes_by_source.get(origin, 0) + n


def _swap_in(new: Path, old: Path) -> None:
    """Replace the copy at ``old`` with ``new`` (both complete): in one step where the
    kernel exchanges two names (renameat2 RENAME_EXCHANGE: a rank opening a file of it
    never finds the directory missing), else the old one moved aside first; the old one is
    removed after (files a rank holds open stay readable until it closes them)."""
    if not _exchange(new, old):
        aside = staging_path(old, "fill-")
        os.rename(old, aside)
        os.rename(new, old)
        new = aside
    fsync_dir(old.parent)
    shutil.rmtree(new, ignore_errors=True)  # (after the exchange: the old copy)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """renameat2(a, b, RENAME_EXCHANGE) (Linux >= 3.15, glibc >= 2.28); False where not."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    return bool(
        renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0
    )


def _sizes_here(root: Path, paths: set[str]) -> dict[str, int]:
    """The size of each of ``paths`` that ``root`` holds as a regular file (a path that
    would lead out of it is not held)."""
    sizes = {}
    for path in paths:
        try:
            st = os.stat(path_in_step_dir(root, check_relative_path(path)), follow_symlinks=False)
        except (OSError, FerryError):
            continue
        if stat.S_ISREG(st.st_mode):
            sizes[path] = st.st_size
    return sizes


def _move_missing(source: Path, target: Path, files: list[FileEntry]) -> None:
    """Rename each file ``target`` lacks from ``source`` (same filesystem: atomic per file)."""
    for entry in files:
        dest = path_in_step_dir(target, entry.path)  # validated relative path
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(source / entry.path, dest)
            fsync_dir(dest.parent)
