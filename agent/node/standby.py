"""Standby replication: the checkpoint is on a survivor before the scheduler decides.

A scheduler that will shrink a job knows its likely survivors before it commits. It
registers each as a standby for the job (``PUT /v1/standby/{job}``, or ``standby_jobs`` in
the agent's config); the standby's agent then polls the tiers every ``standby_poll_seconds``
and, when a newer complete step is durable there, prefetches it in the background: peers
first, deltas against the step it already holds, at most ``standby_max_rate`` bytes per
second (the training job's own traffic comes first). When the decision comes, the
prefetch of that step finds it here, restored and verified by this agent and untouched
since (sizes, mtimes and inodes), and is ready in the time it takes to check that.

With a layout (``PUT /v1/standby/{job}`` with ``{"layout": {"world_size", "ranks"}}``: the
ranks this node will run after the change), only that share of each step is replicated, a
partial copy; the decision's prefetch of that share finds it here and is "held".

Each job's newest replica is held in memory while the node can spare it (agent/node/
resident.py, ``standby_memory``): the load after the decision then reads memory. Older
replicas leave the hot dir through hot retention, as any restored step does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.daemon.logs import event
from agent.node.hotdir import HotDir
from agent.node.prefetch import FINAL, Prefetcher, PrefetchJob, State
from agent.node.resident import Resident, ResidentReplicas
from agent.rpc.services import wait_for_any
from transfer.engine.catalog import latest_complete_step
from transfer.errors import FerryError
from transfer.format.names import check_name
from transfer.store.base import Store
from transfer.store.retry import doubling_wait

log = logging.getLogger(__name__)

#: the longest wait before a standby tries again a step whose replication keeps failing
MAX_RETRY_SECONDS = 600.0


@dataclass
class StandbyJob:
    job: str
    since: float
    #: who asked: "config" (standby_jobs) or "rpc" (PUT /v1/standby/{job})
    source: str
    #: the share to replicate (``{"world_size", "ranks"}``: this node's ranks after the
    #: change); None: every new step whole
    layout: dict[str, Any] | None = None
    #: the newest step a replication made ready here
    replicated_step: int | None = None
    #: the replication running now, if any, and the last one that ended
    running: PrefetchJob | None = None
    last: PrefetchJob | None = None
    last_error: str | None = None
    #: the step whose replication failed last, how many times in a row, and when it is
    #: tried again (monotonic): a step that cannot be restored (torn, its tier down) is
    #: retried with a growing wait, not again the moment its failure wakes the loop
    failed_step: int | None = None
    failures: int = 0
    retry_at: float = 0.0
    #: said when it was registered (no tier held a step of the job: a typo?), until a
    #: step of it is replicated
    warning: str | None = None

    def to_dict(self, resident: Resident | None = None) -> dict[str, Any]:
        running = self.running
        return {
            "job": self.job,
            "since": self.since,
            "source": self.source,
            "layout": self.layout,
            "replicated_step": self.replicated_step,
            "replicating": running.to_dict() if running and running.state not in FINAL else None,
            "last_replication": self.last.to_dict() if self.last else None,
            "last_error": self.last_error,
            "retry_in_seconds": (
                round(max(0.0, self.retry_at - time.monotonic()), 1) if self.failures else None
            ),
            "in_memory": None if resident is None else resident.to_dict(),
            "warning": self.warning if self.replicated_step is None else None,
        }


class Standby:
    def __init__(
        self,
        prefetcher: Prefetcher,
        tiers: list[tuple[str, Store]],
        *,
        hot_dir: HotDir,
        expected_nodes: tuple[str, ...] = (),
        poll_seconds: float = 5.0,
        jobs: tuple[str, ...] = (),
        memory_limit: int | None = None,
    ) -> None:
        self.prefetcher = prefetcher
        #: each job's newest replica, held in memory (``memory_limit``: standby_memory)
        self.resident = ResidentReplicas(memory_limit, prefetcher.holds)
        self.tiers = tiers
        self.hot_dir = hot_dir
        self.expected_nodes = expected_nodes
        self.poll_seconds = poll_seconds
        self.jobs: dict[str, StandbyJob] = {}
        self._poke = asyncio.Event()
        for job in jobs:
            self.register(job, source="config")

    def register(
        self, job: str, *, source: str = "rpc", layout: dict[str, Any] | None = None
    ) -> StandbyJob:
        """Be a standby for ``job`` (idempotent; ``layout``: of that share, which a later
        registration may change); the next poll starts at once."""
        check_name("job", job)
        entry = self.jobs.get(job)
        if entry is None or entry.layout != layout:
            if entry is not None and entry.running is not None:
                self.prefetcher.cancel(entry.running.id)  # it replicates the old share
            entry = self.jobs[job] = StandbyJob(job, time.time(), source, layout)
            event(log, "standby", job=job, source=source, action="registered",
                  layout=None if layout is None else str(layout))  # fmt: skip
        self._poke.set()
        return entry

    def unregister(self, job: str) -> bool:
        """Stop replicating ``job`` (a replication running now is cancelled)."""
        entry = self.jobs.pop(check_name("job", job), None)
        if entry is None:
            return False
        if entry.running is not None:
            self.prefetcher.cancel(entry.running.id)
        event(log, "standby", job=job, action="unregistered")
        self._poke.set()  # (the next poll lets its replica go from memory)
        return True

    def describe(self) -> list[dict[str, Any]]:
        """Each job's status, with its replica held in memory, if any."""
        held = self.resident.held()
        return [e.to_dict(held.get(e.job)) for e in self.jobs.values()]

    async def loop(self, stop: asyncio.Event) -> None:
        watch = asyncio.create_task(self.resident.watch(stop), name="standby-memory")
        try:
            while not stop.is_set():
                await self.poll()
                self._poke.clear()
                # (a replication's end wakes the loop: its replica is held in memory at once)
                ended = [e.running.ended for e in self.jobs.values() if e.running is not None]
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_seconds):
                        await wait_for_any(stop, self._poke, *ended)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            await self.resident.release_all("the agent stops")

    async def poll(self) -> None:
        """One look per registered job: start replicating a newer durable step, if any."""
        for job in self.resident.held():
            if job not in self.jobs:
                await self.resident.release(job, "no longer a standby for it")
        for entry in list(self.jobs.values()):
            try:
                await self._poll_job(entry)
            except FerryError as exc:  # a tier down now: try again at the next poll
                entry.last_error = " ".join(str(exc).split())

    async def _poll_job(self, entry: StandbyJob) -> None:
        running = entry.running
        if running is not None:
            if running.state not in FINAL:
                return
            entry.running, entry.last = None, running
            if running.state is State.READY:
                if running.step is not None and running.dest is not None:  # (in memory first,
                    # so that a scheduler seeing the step replicated sees where it is too)
                    await self.resident.keep(entry.job, running.step, Path(running.dest))
                entry.replicated_step, entry.last_error = running.step, None
                entry.failed_step, entry.failures = None, 0
            else:
                entry.last_error = running.error
                self._back_off(entry, running.step)
        newest = await self._newest_durable(entry.job)
        if newest is None or (entry.replicated_step or -1) >= newest:
            return
        if newest == entry.failed_step and time.monotonic() < entry.retry_at:
            return  # (a newer step is tried at once)
        held = {c.step for c in self.hot_dir.checkpoints(entry.job)}
        if newest in held and not self.prefetcher.is_replica(entry.job, newest):
            entry.replicated_step = newest  # training wrote it here: nothing to replicate
            return
        entry.running = self.prefetcher.submit(
            entry.job, newest, None, background=True, layout=entry.layout
        )

    def _back_off(self, entry: StandbyJob, step: int | None) -> None:
        """After a failed replication of ``step``: wait a poll, then twice as long after
        each further failure of the same step, up to MAX_RETRY_SECONDS."""
        entry.failures = entry.failures + 1 if step == entry.failed_step else 1
        entry.failed_step = step
        wait = doubling_wait(self.poll_seconds, entry.failures, MAX_RETRY_SECONDS)
        entry.retry_at = time.monotonic() + wait
        event(log, "standby", job=entry.job, step=step, action="retry_later",
              failures=entry.failures, retry_in=round(wait, 1))  # fmt: skip

    async def _newest_durable(self, job: str) -> int | None:
        """The newest complete step of ``job`` in the first tier that answers (what a
        prefetch of "latest" restores: never a step still landing, or torn)."""
        for _, store in self.tiers:
            try:
                return await latest_complete_step(store, job, self.expected_nodes)
            except FerryError:  # (none whole there, or it did not answer: the next tier)
                continue
        return None
