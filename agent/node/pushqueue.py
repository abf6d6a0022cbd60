"""Background pushes: every committed checkpoint of this node goes to every tier, hot to cold.

The watcher only enqueues (a set insert and one journal write), so training never waits on a
push. One worker task pushes one checkpoint at a time, tier by tier: the tiers share the
node's uplink and disk, and one push already keeps ``window`` parts in flight. Tiers are
independent (each push reads the local directory), so a failing tier does not stop the next.

Every outcome is in the journal (``states()``), not only in a log. A failed tier is retried
with exponential backoff (at most MAX_RETRY_SECONDS apart): for as long as it cannot be
reached (down, its mount or bucket missing: ``tier_unreachable``), since an outage of a
few minutes must not leave a step pushed nowhere; after any other failure ``max_attempts``
attempts in all, and then it stays ``failed`` (an ERROR line says so) until the agent
restarts (``resume_pending``), while newer checkpoints carry on normally.

Multi-node jobs: after a push to a tier, when every node of ``expected_nodes`` has a
manifest for the step there, a completion marker ``complete/<job>/<step:018d>.json`` is
written create-only. Every node writes its manifest before it looks, so the last of them
always sees all the manifests; when two see them at once, create-only lets exactly one win.
The marker is checked before the tier is recorded durable, so a crash in between is repaired
by the resumed (deduplicated) push.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.daemon.config import AgentConfig
from agent.daemon.logs import event
from agent.node.journal import DURABLE, Journal
from agent.rpc.metrics import Metrics
from agent.rpc.services import Spawn, own_task
from transfer.engine import PushPlan, PushResult, TransferOptions, push
from transfer.engine.catalog import Catalog, step_is_complete
from transfer.engine.parts import check_step_whole, completion_doc
from transfer.engine.scan import SourceFile, scan_checkpoint, scan_files
from transfer.errors import (
    AlreadyExistsError,
    FerryError,
    FormatError,
    IncompleteStepError,
    SourceChangedError,
    StoreMissingError,
    StoreUnavailableError,
)
from transfer.format.layout import completion_key
from transfer.format.names import check_name
from transfer.store.base import Store
from transfer.store.retry import doubling_wait

log = logging.getLogger(__name__)

#: the longest wait between two tries of a push that keeps failing
MAX_RETRY_SECONDS = 600.0
#: when a pushed step's files are looked at again (a file that came late is in no tier)
RECHECK_SECONDS = (30.0, 300.0)

JOURNAL_FILE = "journal.sqlite3"


@dataclass
class _Item:
    job: str
    step: int
    path: Path
    attempt: int = 1
    #: the step's files (path, size, mtime, inode) when last looked at, and when (monotonic)
    seen: tuple[tuple[str, int, int, int], ...] | None = None
    seen_at: float = 0.0


@dataclass
class TierStats:
    pushes_ok: int = 0
    pushes_failed: int = 0
    bytes_transferred: int = 0
    last_push_seconds: float | None = None
    #: bytes written / raw bytes of the last push: what dedupe + deltas + zstd achieved
    last_written_ratio: float | None = None


@dataclass
class PushStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    completions_written: int = 0
    steps_torn: int = 0  # steps whose parts were all in but did not make the whole save


class PushQueue:
    """Owns the worker task, the retry timers and the journal's writes."""

    def __init__(
        self,
        tiers: Sequence[tuple[str, Store]],
        journal: Journal,
        *,
        node: str,
        options: TransferOptions,
        expected_nodes: Sequence[str] = (),
        max_attempts: int = 3,
        retry_seconds: float = 30.0,
        quiet_seconds: float = 2.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.tiers = list(tiers)
        self.journal = journal
        self.node = check_name("node", node)
        self.options = options
        self.expected_nodes = tuple(expected_nodes)
        self.max_attempts = max_attempts
        self.retry_seconds = retry_seconds
        #: a step is pushed once none of its files changed for this long (its commit
        #: marker can come first: ``cp -r`` and ``rsync`` copy ``.metadata`` before shards)
        self.quiet_seconds = quiet_seconds
        self.stats = PushStats({name: TierStats() for name, _ in self.tiers})
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queued: set[tuple[str, int]] = set()  # queued, in flight or waiting to retry
        self._timers: dict[tuple[str, int], asyncio.TimerHandle] = {}  # retries
        #: second looks at pushed steps' files (_watch_after_push), and those running
        self._recheck_timers: list[asyncio.TimerHandle] = []
        self._recheck_tasks: set[asyncio.Future[None]] = set()
        self._said_late: set[tuple[str, int, tuple[str, ...]]] = set()
        self._current: tuple[str, int, str] | None = None  # (job, step, tier) being pushed
        self._worker: asyncio.Task[None] | None = None
        self._closing = False
        #: called after each checkpoint's pushes (retention runs then)
        self.on_pushed: Callable[[], None] | None = None

    @classmethod
    def from_config(cls, config: AgentConfig, tiers: Sequence[tuple[str, Store]]) -> PushQueue:
        """The agent's queue: journal in ``config.state_dir``, the config's node and options."""
        return cls(
            tiers,
            open_journal(config.state_dir, config.node),
            node=config.node,
            options=config.transfer_options(),
            expected_nodes=config.expected_nodes,
            quiet_seconds=config.quiet_seconds,
        )

    @property
    def idle(self) -> bool:
        """Nothing queued, in flight or scheduled for a retry."""
        return not self._queued

    async def start(self, spawn: Spawn = own_task) -> None:
        """Re-enqueue what the journal says is unfinished, then start the worker (``spawn``:
        in the agent, its services' group owns it; ``drain`` stops it either way)."""
        if self._worker is not None:
            raise RuntimeError("push queue already started")
        self.resume_pending()
        self._worker = spawn(self._run(), name=f"push-queue-{self.node}")

    def resume_pending(self) -> int:
        """Enqueue every journalled checkpoint not durable in every tier; returns how many."""
        names = [name for name, _ in self.tiers]
        return sum(self.enqueue(job, step, path) for job, step, path in self.journal.pending(names))

    def enqueue(self, job: str, step: int, path: Path) -> bool:
        """Queue a committed checkpoint unless it is queued already, durable in every tier,
        or was restored here from a store. Never blocks; returns whether it was queued."""
        key = (job, step)
        if self._closing or key in self._queued or not self.journal.pushable(job, step):
            return False
        # the watcher scans in a thread: hot retention may have evicted the step since (and
        # forgotten that it was a restore); checked here, on the loop, where evictions happen
        if not path.is_dir():
            return False
        if self.pushed_everywhere(job, step):
            return False
        names = [name for name, _ in self.tiers]
        self.journal.record_staged(job, step, path, names)
        self._queued.add(key)
        self._queue.put_nowait(_Item(job, step, path))
        return True

    def on_committed(self, job: str, step: int, path: Path) -> None:
        """The watcher's callback."""
        self.enqueue(job, step, path)

    def busy_steps(self) -> set[tuple[str, int]]:
        """Steps queued, being pushed or waiting to retry: none may leave the hot dir."""
        return set(self._queued)

    def pushed_everywhere(self, job: str, step: int) -> bool:
        """Whether this node's part of (job, step) is durable in every tier: nothing of it is
        left to push (a prefetch may then add a share to it in place)."""
        return {name for name, _ in self.tiers} <= self.journal.durable_tiers(job, step)

    def exclude(self, job: str, step: int) -> None:
        """Never push (job, step) from this node: it is being restored here from a store (a
        prefetch), so it holds other nodes' data. Call before the restore starts."""
        self.journal.record_restored(job, step)

    def keep_own_part(self, job: str, step: int, path: Path, files: frozenset[str]) -> None:
        """A prefetch is about to add other nodes' data (the step, or a share of it) to this
        node's own part of (job, step) at ``path``, its ``files``: those files alone go on
        being pushed, to every tier they are not durable in yet (queued now, in case the
        watcher has not seen the step, or never will: a partial copy is no save). Call
        before anything is added."""
        if self.journal.is_restored(job, step) and self.journal.own_files(job, step) is None:
            # (an earlier restore added to it without naming them: what is whose is lost)
            log.warning("%s step %s was restored here before: its own files are not known, "
                        "and it is not pushed again", job, step)  # fmt: skip
            return
        self.journal.record_restored(job, step, sorted(files))
        self.enqueue(job, step, path)

    def states(self) -> list[dict[str, Any]]:
        """The journal's rows, with ``pushing`` set on the tier being pushed right now and
        ``will_retry`` on rows that are not durable yet but will be tried again (a ``failed``
        row without it has used up its attempts)."""
        rows = self.journal.states()
        for row in rows:
            row["pushing"] = (row["job"], row["step"], row["tier"]) == self._current
            queued = (row["job"], row["step"]) in self._queued
            row["will_retry"] = queued and row["state"] != DURABLE and not row["pushing"]
        return rows

    def publish(self, metrics: Metrics) -> None:
        """Copy the counters into the agent's metrics (call it from the /metrics handler)."""
        metrics.set("ferry_push_queue_depth", len(self._queued))
        metrics.set("ferry_push_completions_written_total", self.stats.completions_written)
        metrics.set("ferry_push_steps_torn_total", self.stats.steps_torn)
        for tier, s in self.stats.tiers.items():
            metrics.set("ferry_push_total", s.pushes_ok, tier=tier, result="ok")
            metrics.set("ferry_push_total", s.pushes_failed, tier=tier, result="failed")
            metrics.set("ferry_push_bytes_total", s.bytes_transferred, tier=tier)
            if s.last_push_seconds is not None:
                metrics.set("ferry_push_last_seconds", s.last_push_seconds, tier=tier)
            if s.last_written_ratio is not None:
                metrics.set("ferry_push_written_ratio", s.last_written_ratio, tier=tier)

    async def drain(self, seconds: float) -> None:
        """Stop taking work, let the push in flight finish for up to ``seconds``, then cancel
        it. Whatever did not finish stays ``staged`` in the journal for the next start."""
        self._closing = True
        for timer in [*self._timers.values(), *self._recheck_timers]:
            timer.cancel()
        self._timers.clear()
        for task in list(self._recheck_tasks):
            task.cancel()
        worker, self._worker = self._worker, None
        if worker is None:
            return
        if self._current is not None:
            await asyncio.wait({worker}, timeout=seconds)
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker

    def close(self) -> None:
        """Close the journal (after ``drain``)."""
        self.journal.close()

    async def _run(self) -> None:
        while not self._closing:
            item = await self._queue.get()
            try:
                await self._process(item)
            except Exception:  # a bug must not end every later push
                log.exception("push of %s step %s failed unexpectedly", item.job, item.step)
                self._queued.discard((item.job, item.step))

    async def _process(self, item: _Item) -> None:
        key = (item.job, item.step)
        if not self.journal.pushable(item.job, item.step):  # restored since it was queued:
            self._queued.discard(key)  # its directory is other nodes' data now
            return
        durable = self.journal.durable_tiers(item.job, item.step)
        failed, unreachable = False, True  # (every failure so far: a tier that did not answer)
        try:
            await self._check_quiet(item)
        except _NotQuiet as exc:
            self._wait_for_quiet(item, durable, exc)
            return
        except (FerryError, OSError):
            pass  # gone or unreadable: the push below reports it like any failure
        for name, store in self.tiers:
            if name in durable:
                continue
            if self._closing:
                return  # draining: the rest stays staged for the next start
            self._current = (item.job, item.step, name)
            try:
                result = await self._push_to(name, store, item)
            except SourceChangedError as exc:  # nothing committed: push it once it settles
                self._current = None
                self._wait_for_quiet(item, durable, exc)
                return
            except Exception as exc:  # every failure must reach the journal, whatever its type
                error = " ".join(str(exc).split()) or type(exc).__name__
                unreachable = unreachable and tier_unreachable(exc)
                attempts = "until it answers" if tier_unreachable(exc) else self.max_attempts
                event(log, "push", level=logging.WARNING, job=item.job, step=item.step,
                      tier=name, outcome="failed", attempt=item.attempt, attempts=attempts,
                      error=error)  # fmt: skip
                self.journal.record_failed(item.job, item.step, name, error)
                self.stats.tiers[name].pushes_failed += 1
                failed = True
                continue
            finally:
                self._current = None
            self._record_durable(name, item, result)
        retrying = item.attempt < self.max_attempts or unreachable
        if failed and retrying and not self._closing:
            wait = doubling_wait(self.retry_seconds, item.attempt, MAX_RETRY_SECONDS)
            retry = _Item(item.job, item.step, item.path, item.attempt + 1)
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(wait, self._retry, retry)
            return
        if failed and not self._closing:
            event(log, "push", level=logging.ERROR, job=item.job, step=item.step,
                  outcome="gave_up", attempts=item.attempt,
                  reason="failed every attempt: not retried until the agent restarts")  # fmt: skip
        self._queued.discard(key)
        if not failed and item.seen is not None and not self._closing:
            self._watch_after_push(item)
        if self.on_pushed is not None:
            self.on_pushed()

    def _watch_after_push(self, item: _Item) -> None:
        """Look at a pushed step's files again later (RECHECK_SECONDS after): one that came
        or grew after the push is in no tier, and the part is committed without it for good
        (its writer paused longer than ``quiet_seconds``: a newcomer's trial wrote a node's
        second shard 6 s after its first). Said in an ERROR line naming the files."""
        loop = asyncio.get_running_loop()
        now = loop.time()  # (the timers that fired already are dropped as new ones come)
        self._recheck_timers = [t for t in self._recheck_timers if t.when() > now]
        for delay in RECHECK_SECONDS:
            timer = loop.call_later(delay, lambda: self._spawn_recheck(item))
            self._recheck_timers.append(timer)

    def _spawn_recheck(self, item: _Item) -> None:
        task = asyncio.ensure_future(self._recheck(item))
        self._recheck_tasks.add(task)
        task.add_done_callback(self._recheck_tasks.discard)

    async def _recheck(self, item: _Item) -> None:
        if self._closing or not self.journal.pushable(item.job, item.step):
            return  # (restored here since: the directory holds other nodes' data now)
        try:
            now = await self._scan_own(item)
        except (FerryError, OSError):
            return  # gone (evicted, deleted): nothing to say
        pushed = {path: size for path, size, _, _ in item.seen or ()}
        late = sorted(f.path for f in now if pushed.get(f.path) != f.size)
        said = (item.job, item.step, tuple(late))
        if late and item.path.is_dir() and said not in self._said_late:
            self._said_late.add(said)  # (once: the later look finds the same files)
            event(log, "push", level=logging.ERROR, job=item.job, step=item.step,
                  outcome="changed_after_push", files=",".join(late[:8]),
                  reason=f"{len(late)} file(s) came or changed after this node's part was "
                  f"pushed (quiet_seconds {self.quiet_seconds:g} too short for this writer?): "
                  "no tier holds them, and the step there is torn")  # fmt: skip

    async def _push_to(self, name: str, store: Store, item: _Item) -> PushResult:
        """One push of the step to one tier, resuming what the journal says an earlier
        attempt made durable; then the step's completion marker, if it is whole."""
        job, step = item.job, item.step
        result = await push(
            store,
            item.path,
            job=job,
            step=step,
            node=self.node,
            options=self.options,
            plan=PushPlan(
                resume=self.journal.resume(job, step, name),
                part=bool(self.expected_nodes),  # a multi-node job: this node's part of each save
                create_store=False,  # the agent never makes a store (`ferry init` does)
                files=self._own_files(job, step),
            ),
        )
        await self._complete_if_all_pushed(store, job, step)
        return result

    def _record_durable(self, name: str, item: _Item, result: PushResult) -> None:
        self.journal.record_durable(item.job, item.step, name, result.to_dict())
        event(log, "push", job=item.job, step=item.step, tier=name, outcome="durable",
              bytes_raw=result.bytes_raw, bytes_written=result.bytes_transferred,
              seconds=round(result.seconds, 3), base_step=result.base_step)  # fmt: skip
        tier = self.stats.tiers[name]
        tier.pushes_ok += 1
        tier.bytes_transferred += result.bytes_transferred
        tier.last_push_seconds = result.seconds
        tier.last_written_ratio = result.bytes_transferred / max(result.bytes_raw, 1)

    async def _check_quiet(self, item: _Item) -> None:
        """Pass once the step's files looked the same ``quiet_seconds`` apart: their mtimes
        alone would not do (``cp -p`` and ``rsync -a`` set old ones while they copy)."""
        if self.quiet_seconds <= 0:
            return
        sources = await self._scan_own(item)
        seen = tuple((f.path, f.size, f.mtime_ns, f.inode) for f in sources)
        now = time.monotonic()
        if seen != item.seen:
            first = item.seen is None
            item.seen, item.seen_at = seen, now
            raise _NotQuiet(
                f"waiting {self.quiet_seconds:g} s for its files to be quiet"
                if first
                else f"{item.path} is still being written; pushed once quiet for "
                f"{self.quiet_seconds:g} s",
                self.quiet_seconds,
            )
        if now - item.seen_at < self.quiet_seconds:
            raise _NotQuiet(
                "waiting for its files to be quiet", self.quiet_seconds - (now - item.seen_at)
            )

    async def _scan_own(self, item: _Item) -> list[SourceFile]:
        """This node's files of the step (what a prefetch moved in beside them is not)."""
        own = self._own_files(item.job, item.step)
        if own is None:
            return await asyncio.to_thread(scan_checkpoint, item.path)
        return await asyncio.to_thread(scan_files, item.path, own)

    def _own_files(self, job: str, step: int) -> frozenset[str] | None:
        """This node's own files of a step a prefetch added to; None: the directory's."""
        own = self.journal.own_files(job, step)
        return None if own is None else frozenset(own)

    def _wait_for_quiet(self, item: _Item, durable: set[str], exc: BaseException) -> None:
        """The checkpoint is still being written: note why, try again later. Not a failed
        attempt (a slow copy into the hot dir must not use up the retries)."""
        reason = " ".join(str(exc).split()) or type(exc).__name__
        event(log, "push", job=item.job, step=item.step, outcome="waiting", reason=reason)
        if not isinstance(exc, _NotQuiet):
            item.seen = None  # it changed under the push: watch it settle from scratch
        for name, _ in self.tiers:
            if name not in durable:
                self.journal.record_waiting(item.job, item.step, name, reason)
        if self._closing:
            return
        loop = asyncio.get_running_loop()
        delay = exc.seconds if isinstance(exc, _NotQuiet) else max(self.quiet_seconds, 0.2)
        self._timers[(item.job, item.step)] = loop.call_later(delay, self._retry, item)

    def _retry(self, item: _Item) -> None:
        self._timers.pop((item.job, item.step), None)
        self._queue.put_nowait(item)

    async def _complete_if_all_pushed(self, store: Store, job: str, step: int) -> bool:
        """Write the completion marker when every expected node's part is in ``store`` and
        together they hold the whole save (parts.check_step_whole: read once per step, by
        the node that finds the last part in); True only when this call created it."""
        if not self.expected_nodes:
            return False
        catalog = Catalog(store)
        nodes = {c.node for c in await catalog.parts(job, step)}
        if not step_is_complete(nodes, False, self.expected_nodes, job_writes_markers=True):
            return False  # (the marker is what this writes: it cannot be there yet)
        try:
            whole = await check_step_whole(catalog, job, step)
        except (IncompleteStepError, FormatError) as exc:
            self.stats.steps_torn += 1
            event(log, "step_torn", level=logging.ERROR, job=job, step=step, tier=store.url,
                  error=str(exc))  # fmt: skip
            return False
        doc = await asyncio.to_thread(completion_doc, job, step, whole)
        try:
            await store.put(completion_key(job, step), json.dumps(doc).encode(), create_only=True)
        except AlreadyExistsError:
            return False  # another node saw the same and wrote it first
        self.stats.completions_written += 1
        event(
            log, "step_complete", job=job, step=step, tier=store.url, nodes=",".join(sorted(nodes))
        )
        return True


def tier_unreachable(exc: BaseException) -> bool:
    """A failure of a tier that did not answer (every try of a request failed on the
    network, the server or a flaky mount; its directory or bucket missing: a mount not
    there yet), worth retrying for as long as it lasts, unlike a refusal (access denied,
    not a store, no space left, other content committed) or a bad checkpoint."""
    unavailable = (StoreUnavailableError, StoreMissingError, ConnectionError, TimeoutError)
    return isinstance(exc, unavailable)


class _NotQuiet(SourceChangedError):
    def __init__(self, message: str, seconds: float) -> None:
        super().__init__(message)
        self.seconds = max(seconds, 0.05)  # when to look again


def open_journal(state_dir: Path, node: str) -> Journal:
    return Journal(state_dir / JOURNAL_FILE, node)


__all__ = [
    "PushQueue",
    "PushStats",
    "TierStats",
    "completion_key",
    "open_journal",
]
