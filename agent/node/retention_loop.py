"""The agent's retention loop: every ``interval_seconds`` and after each push, trim the hot
dir and every store tier to their policies, then collect garbage; results go to /metrics
and ``GET /v1/retention``.

Every agent of a fleet runs this against the shared tiers; a store's lease lets one run at
a time, and the others skip it that round. Pins come from three places: the store (any
node's RPC pins and prefetches), this agent's RPC pins, and steps in use on this node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from agent.daemon.config import RetentionSettings
from agent.daemon.logs import event
from agent.node.hotdir import HotDir
from agent.node.hotretention import apply_hot, plan_hot
from agent.node.journal import Journal
from agent.node.protected import ProtectedSteps
from agent.rpc.metrics import Metrics
from agent.rpc.services import wait_for_any
from transfer.errors import FerryError
from transfer.options import TransferOptions
from transfer.retention import Tier, apply_plan, make_plan
from transfer.store.base import Store

log = logging.getLogger(__name__)


class RetentionRunner:
    def __init__(
        self,
        settings: RetentionSettings,
        *,
        node: str,
        hot_dir: HotDir,
        tiers: Sequence[tuple[str, Store]],
        journal: Journal,
        protected: ProtectedSteps,
        metrics: Metrics,
        options: TransferOptions | None = None,
    ) -> None:
        self.settings = settings
        self.options = options or TransferOptions()
        self.node = node
        self.hot_dir = hot_dir
        self.tiers = list(tiers)
        self.journal = journal
        self.protected = protected
        self.metrics = metrics
        self.last: dict[str, Any] | None = None
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        swept = hot_dir.sweep_evictions()
        if swept:
            log.info("removed %d half-evicted directories", len(swept))

    def poke(self) -> None:
        """Run soon (after a push: the new step may let an older one go)."""
        self._wake.set()

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.interval_seconds):
                    await wait_for_any(self._wake, stop)
            if stop.is_set():
                return
            self._wake.clear()
            try:
                await self.run_once()
            except Exception:  # a bug must not end retention for good
                log.exception("retention run failed")

    async def run_once(self, *, dry_run: bool = False) -> dict[str, Any]:
        async with self._lock:  # one run at a time on this node
            began = time.monotonic()
            now = time.time()
            report: dict[str, Any] = {"started_at": now, "dry_run": dry_run, "node": self.node}
            hot = await plan_hot(
                self.hot_dir,
                node=self.node,
                keep_last=self.settings.hot_keep_last,
                budget_bytes=self.settings.hot_budget_bytes,
                min_free_bytes=self.settings.hot_min_free_bytes,
                tiers=self.tiers,
                journal=self.journal,
                protected=self.protected.now(),
            )
            if not dry_run:
                hot = await apply_hot(self.hot_dir, hot, self.journal, self.protected.now)
            report["hot"] = hot.to_dict()
            tiers = [
                Tier(store, self.settings.tier_policy(i)) for i, (_, store) in enumerate(self.tiers)
            ]
            try:
                plan = await make_plan(
                    tiers,
                    now=now,
                    pins=self.protected.now(),
                    repacking=self.settings.repack_policy(self.options),
                )
                await apply_plan(
                    plan,
                    tiers,
                    grace_s=self.settings.grace_seconds,
                    holder=f"agent-{self.node}",
                    deep_verify=self.settings.deep_verify,
                    dry_run=dry_run,
                )
                report["tiers"] = plan.to_dict()["tiers"]
                errors = [e for t in plan.tiers for e in t.errors]
            except FerryError as exc:
                plan = None
                report["tiers"] = []
                errors = [str(exc)]
            report["errors"] = hot.errors + errors
            report["seconds"] = time.monotonic() - began
            if not dry_run:
                self._record(report, hot, plan)
                self.last = report
            return report

    def _record(self, report: dict[str, Any], hot: Any, plan: Any) -> None:
        m = self.metrics
        m.inc("ferry_retention_runs_total", result="error" if report["errors"] else "ok")
        m.set("ferry_retention_last_run_timestamp", time.time())
        m.set("ferry_retention_last_seconds", report["seconds"])
        m.set("ferry_retention_errors", len(report["errors"]))
        m.set(
            "ferry_tier_bytes",
            hot.bytes_before - sum(s.bytes for s in hot.steps if s.path in hot.evicted),
            tier="hot",
        )
        m.inc("ferry_hot_evicted_total", len(hot.evicted))
        m.set("ferry_journal_rows", self.journal.row_count())
        # a tier's label is its URL as configured (as the push queue's), not the store's
        # resolved URL (an absolute path for a relative one): one label per tier
        names = {store.url: name for name, store in self.tiers}
        for t in plan.tiers if plan else []:
            tier = names.get(t.url, t.url)
            for a in t.done:
                event(log, "tier_" + a.action, tier=tier, job=a.job, step=a.step,
                      reason=a.reason)  # fmt: skip
            if t.repack is not None and t.repack.parts_rewritten:
                r = t.repack
                event(log, "repack", tier=tier, parts=r.parts_rewritten, moved=r.bytes_moved,
                      reencoded=r.chunks_reencoded, packs_vacated=len(r.packs_vacated))  # fmt: skip
                m.inc("ferry_repack_moved_bytes_total", r.bytes_moved, tier=tier)
                m.inc("ferry_repack_reencoded_chunks_total", r.chunks_reencoded, tier=tier)
            if t.gc is not None and t.gc.deleted_packs:
                event(log, "gc", tier=tier, packs_deleted=len(t.gc.deleted_packs),
                      bytes_freed=t.gc.freed_bytes)  # fmt: skip
            freed = t.gc.freed_bytes if t.gc else 0  # manifests are noise next to packs
            m.set("ferry_tier_bytes", t.bytes_before - freed, tier=tier)
            m.inc("ferry_retention_expired_total", len(t.done), tier=tier)
            if t.gc is not None:
                m.inc("ferry_gc_deleted_packs_total", len(t.gc.deleted_packs), tier=tier)
                m.inc("ferry_gc_freed_bytes_total", t.gc.freed_bytes, tier=tier)
                m.set("ferry_gc_marked_packs", t.gc.marked_packs, tier=tier)
