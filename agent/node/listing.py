"""The checkpoint listing (GET /v1/checkpoints): per job, every step a tier or this node
holds, with the tiers and nodes that hold it, its raw size, whether it is whole (the
catalog's rule), held here (and as a standby's replica), a partial copy here (the share it
holds), pinned, and this node's pushes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from agent.daemon.config import AgentConfig
from agent.node.prefetch import Prefetcher
from agent.node.protected import LocalPins
from agent.node.pushqueue import PushQueue
from transfer.engine.catalog import (
    CheckpointInfo,
    complete_steps,
    list_checkpoints,
    load_manifest,
    open_catalog,
)
from transfer.engine.share import read_record
from transfer.errors import FerryError, StoreError
from transfer.store.base import Store

Entry = dict[str, Any]  # one step's line of the listing
PartSizes = dict[tuple[str, str, int, str], int]  # (tier, job, step, node) -> raw bytes


@dataclass(frozen=True)
class CheckpointListing:
    """One listing, built from the tiers and this node's state. ``part_sizes`` caches each
    committed part's raw size across listings: manifests are immutable, so each is read
    once."""

    config: AgentConfig
    tiers: list[tuple[str, Store]]
    prefetcher: Prefetcher
    pins: LocalPins
    queue: PushQueue
    part_sizes: PartSizes

    async def document(self) -> dict[str, Any]:
        """``{"jobs": {job: [entry by step]}}``, plus ``unreachable_tiers`` when a tier could
        not be read (StoreError when none could)."""
        jobs: dict[str, dict[int, Entry]] = {}
        unreachable: dict[str, str] = {}
        readable: list[tuple[str, Store]] = []
        for name, store in self.tiers:
            try:  # one tier that is down must not hide what the others hold
                listed = (
                    await list_checkpoints(store) if await open_catalog(store, create=False) else []
                )
            except StoreError as exc:
                unreachable[name] = " ".join(str(exc).split())
                continue
            readable.append((name, store))
            for c in listed:
                await self._add_part(jobs, name, store, c)
        if unreachable and not readable:
            raise StoreError("; ".join(f"{n}: {e}" for n, e in unreachable.items()))
        pushes = self.queue.states()
        for job, steps in jobs.items():
            await self._describe(job, steps, readable, pushes)
        listing = {
            job: sorted(steps.values(), key=lambda e: e["step"]) for job, steps in jobs.items()
        }
        doc: dict[str, Any] = {"jobs": listing}
        if unreachable:
            doc["unreachable_tiers"] = unreachable
        return doc

    async def _add_part(
        self, jobs: dict[str, dict[int, Entry]], tier: str, store: Store, c: CheckpointInfo
    ) -> None:
        entry = jobs.setdefault(c.job, {}).setdefault(
            c.step,
            {
                "step": c.step,
                "tiers": [],
                "nodes": [],
                "bytes": 0,
                "local": False,
                "replica": False,
            },
        )
        if tier not in entry["tiers"]:
            entry["tiers"].append(tier)
        if c.node not in entry["nodes"]:
            entry["nodes"].append(c.node)
            entry["bytes"] += await self._part_size(tier, store, c)

    async def _describe(
        self,
        job: str,
        steps: dict[int, Entry],
        readable: list[tuple[str, Store]],
        pushes: list[dict[str, Any]],
    ) -> None:
        """Held here, whole, pinned and this node's pushes, for each listed step of ``job``."""
        for held in self.config.hot.checkpoints(job):
            if held.step in steps:
                steps[held.step]["local"] = True
                steps[held.step]["replica"] = self.prefetcher.is_replica(job, held.step)
        for entry in steps.values():  # a partial copy here: what it holds, never "local"
            entry["share"] = await asyncio.to_thread(self._share_here, job, entry["step"])
        # whole on some tier (catalog.step_is_complete), asked once per tier, not per step
        whole = {
            name: await complete_steps(store, job, self.config.expected_nodes)
            for name, store in readable
            if any(name in entry["tiers"] for entry in steps.values())
        }
        for entry in steps.values():
            entry["complete"] = any(entry["step"] in whole.get(n, ()) for n in entry["tiers"])
            entry["pinned"] = self.pins.pinned(job, entry["step"])
            entry["pushes"] = {  # this node's background pushes: staged/durable/failed
                row["tier"]: row["state"]
                for row in pushes
                if row["job"] == job and row["step"] == entry["step"]
            }

    def _share_here(self, job: str, step: int) -> dict[str, Any] | None:
        """The share a partial copy of the step here holds (share.py's record), or None."""
        path = self.config.hot.step_path(job, step)
        if not self.config.hot.is_share(path):
            return None
        record = read_record(path) or {}
        return {k: record.get(k) for k in ("layout", "bytes")}

    async def _part_size(self, tier: str, store: Store, c: CheckpointInfo) -> int:
        """Raw bytes of one committed part (0 if its manifest is unreadable: listed, size
        unknown)."""
        key = (tier, c.job, c.step, c.node)
        if key not in self.part_sizes:
            try:
                manifest = await load_manifest(store, c.job, c.step, c.node)
            except FerryError:
                return 0
            self.part_sizes[key] = manifest.bytes_raw
        return int(self.part_sizes[key])
