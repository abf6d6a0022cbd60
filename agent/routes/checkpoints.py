"""What the tiers and this node hold, this node's pushes, and what moving a checkpoint
here would cost."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agent import probe
from agent.appkeys import CONFIG, METER, PART_SIZES, PINS, PREFETCHER, PUSHQUEUE, TIERS
from agent.estimate import PREFETCH_START_SECONDS, estimate_migration
from agent.hotdir import LocalCheckpoint
from agent.middleware import parse_step_arg
from transfer.engine import list_checkpoints
from transfer.engine.catalog import (
    CheckpointInfo,
    complete_steps,
    load_manifest,
    open_catalog,
    resolve_checkpoint,
)
from transfer.engine.chunkindex import ChunkIndex
from transfer.engine.pull import local_bases
from transfer.errors import CheckpointNotFoundError, FerryError, StoreError
from transfer.format.manifest import Manifest
from transfer.format.names import check_name
from transfer.store.base import Store

log = logging.getLogger(__name__)


async def get_checkpoints(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    jobs: dict[str, dict[int, dict[str, Any]]] = {}
    unreachable: dict[str, str] = {}
    readable: list[tuple[str, Store]] = []
    for name, store in request.app[TIERS]:
        try:  # one tier that is down must not hide what the others hold
            listed = (
                await list_checkpoints(store) if await open_catalog(store, create=False) else []
            )
        except StoreError as exc:
            unreachable[name] = " ".join(str(exc).split())
            continue
        readable.append((name, store))
        for c in listed:
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
            if name not in entry["tiers"]:
                entry["tiers"].append(name)
            if c.node not in entry["nodes"]:
                entry["nodes"].append(c.node)
                entry["bytes"] += await _part_size(request.app, name, store, c)
    for job, steps in jobs.items():
        prefetcher = request.app[PREFETCHER]
        for held in config.hot.checkpoints(job):
            if held.step in steps:
                steps[held.step]["local"] = True
                steps[held.step]["replica"] = prefetcher.is_replica(job, held.step)
        # whole on some tier (catalog.step_is_complete), asked once per tier, not per step
        whole = {
            name: await complete_steps(store, job, config.expected_nodes)
            for name, store in readable
            if any(name in entry["tiers"] for entry in steps.values())
        }
        for entry in steps.values():
            entry["complete"] = any(entry["step"] in whole.get(n, ()) for n in entry["tiers"])
            entry["pinned"] = request.app[PINS].pinned(job, entry["step"])
            entry["pushes"] = {  # this node's background pushes: staged/durable/failed
                row["tier"]: row["state"]
                for row in request.app[PUSHQUEUE].states()
                if row["job"] == job and row["step"] == entry["step"]
            }
    if unreachable and not readable:
        raise StoreError("; ".join(f"{n}: {e}" for n, e in unreachable.items()))
    listing = {job: sorted(steps.values(), key=lambda e: e["step"]) for job, steps in jobs.items()}
    doc: dict[str, Any] = {"jobs": listing}
    if unreachable:
        doc["unreachable_tiers"] = unreachable
    return web.json_response(doc)


async def _part_size(app: web.Application, tier: str, store: Store, c: CheckpointInfo) -> int:
    """Raw bytes of one committed part; manifests are immutable, so each is read once."""
    key = (tier, c.job, c.step, c.node)
    cache = app[PART_SIZES]
    if key not in cache:
        try:
            cache[key] = (await load_manifest(store, c.job, c.step, c.node)).bytes_raw
        except FerryError:
            return 0  # unreadable: listed, size unknown
    return int(cache[key])


async def get_pushes(request: web.Request) -> web.Response:
    """Background pushes of this node's checkpoints: staged, durable per tier, or failed."""
    queue = request.app[PUSHQUEUE]
    return web.json_response({"node": request.app[CONFIG].node, "pushes": queue.states()})


async def get_estimate(request: web.Request) -> web.Response:
    query = request.query
    job = check_name("job", query.get("job"))
    step = parse_step_arg(query.get("step", "latest"))
    gpus = int(query.get("gpus", "1"))
    price = float(query.get("gpu_hour_price", "0"))
    if not 0 <= gpus <= 1_000_000 or not (math.isfinite(price) and 0 <= price <= 1e6):
        raise ValueError("gpus must be in 0..1000000 and gpu_hour_price a price in 0..1e6")
    config = request.app[CONFIG]
    unreachable: list[str] = []
    for name, store in request.app[TIERS]:
        try:
            manifests = await resolve_checkpoint(store, job, step, config.expected_nodes)
            total = sum(f.size for m in manifests for f in m.files)
            here = _held_here(request.app, job, manifests[0].step)
            if here is not None:  # nothing moves: a replica is checked by stat, a copy re-hashed
                sourcing = await _held_sourcing(request.app, job, manifests[0].step, here, total)
            else:
                held = await _held_manifests(request.app, store, job, manifests[0].step)
                sourcing = await _source_of(request.app, name, store, manifests, held)
        except CheckpointNotFoundError:
            continue
        except StoreError as exc:  # the next tier may answer (as a prefetch would use it)
            unreachable.append(f"{name}: {' '.join(str(exc).split())}")
            continue
        est = estimate_migration(
            sourcing.moving,
            request.app[METER],
            bytes_total=total,
            gpus=gpus,
            gpu_hour_price=price,
            fixed_seconds=PREFETCH_START_SECONDS,
        )
        doc = est.to_dict()
        doc.update(job=job, step=manifests[0].step, node=config.node, source=sourcing.source)
        doc.update(bytes_bases=sourcing.bases, rate_basis=sourcing.rate_basis)
        return web.json_response(doc)
    which = "latest" if step is None else str(step)
    if unreachable:
        raise StoreError(
            f"no reachable tier holds job {job!r} step {which}; " + "; ".join(unreachable)
        )
    raise CheckpointNotFoundError(f"no tier holds job {job!r} step {which}")


@dataclass(frozen=True)
class _Sourcing:
    source: str  # "peer:<url>" or "tier:<name>"
    moving: dict[str, int]  # meter source -> bytes
    bases: int  # of those, delta bases a node without them fetches too
    rate_basis: str  # "measured" (by transfers or an earlier probe), "probe" (now), "default"


async def _source_of(
    app: web.Application,
    tier: str,
    store: Store,
    manifests: list[Manifest],
    held: dict[LocalCheckpoint, list[Manifest]],
) -> _Sourcing:
    """Where a prefetch would get the chunks this node lacks and what it would move from
    there: the first peer that serves a sample of them (as deltas against what this node
    holds at their positions, as a prefetch asks), else the tier. A source the meter has
    not measured yet is probed (agent/probe.py)."""
    held_ids = {c.id for parts in held.values() for m in parts for c in m.all_chunks()}
    index = ChunkIndex()
    for m in manifests:
        index.add_manifest(m)
    needed = {c.id for m in manifests for f in m.files for c in f.chunks if c.id not in held_ids}
    # what the newest earlier step held here has at each chunk's position
    base = next((c for c in held if c.step < manifests[0].step), None)
    bases = local_bases(base.path, held[base], manifests) if base and needed else {}
    meter, peers = app[METER], app[PREFETCHER].fanout_client
    if app[CONFIG].peers and peers is not None and needed:
        picked = probe.sample(index, needed, bases)
        for peer in peers.peers:
            got = await probe.probe_peer(peers, peer, picked, bases)
            if got is not None:
                basis = "measured" if meter.measured("peer") else "probe"
                if basis == "probe":
                    meter.record("peer", got.moved, got.seconds, provisional=True)
                raw = sum(c.size for cid in needed if (c := index.get(cid)) is not None)
                return _Sourcing(f"peer:{peer}", {"peer": round(raw * got.ratio)}, 0, basis)
    source = f"tier:{tier}"
    basis = "measured" if meter.measured(source) else "default"
    if basis == "default" and needed:
        got = await probe.probe_tier(store, probe.sample(index, needed, bases), bases)
        if got is not None and meter.record(source, got.moved, got.seconds, provisional=True):
            basis = "probe"
    content, bases_moved = _to_move(index, needed, held_ids)
    return _Sourcing(source, {source: content + bases_moved}, bases_moved, basis)


async def _held_sourcing(
    app: web.Application, job: str, step: int, here: str, total: int
) -> _Sourcing:
    """A step held here: a replica is checked by stat (nothing to rate), a copy is re-hashed
    at the local rate, probed on this copy at first contact (the 200 MB/s default was 2x
    slow: a cold re-hash of a 289 MB save took 0.17 s)."""
    if here == "replica":
        return _Sourcing(here, {"local": 0}, 0, "default")
    meter = app[METER]
    basis = "measured" if meter.measured("local") else "default"
    if basis == "default":
        got = await asyncio.to_thread(probe.probe_local, app[CONFIG].hot.step_path(job, step))
        if got is not None and meter.record("local", got.moved, got.seconds, provisional=True):
            basis = "probe"
    return _Sourcing(here, {"local": total}, 0, basis)


def _held_here(app: web.Application, job: str, step: int) -> str | None:
    """ "replica" or "local" when this node holds the step already, else None."""
    config = app[CONFIG]
    for held in config.hot.checkpoints(job):
        if held.step == step:
            return "replica" if app[PREFETCHER].is_replica(job, step) else "local"
    return None


def _to_move(index: ChunkIndex, needed: set[str], held: set[str]) -> tuple[int, int]:
    """Stored bytes a prefetch moves: (the ``needed`` chunks, the delta bases they need that
    this node lacks too: a node without the previous step fetches those as well)."""
    bases: set[str] = set()
    for cid in needed:
        cur = index.get(cid)
        while cur is not None and cur.base is not None and cur.base not in held:
            if cur.base in needed or cur.base in bases:
                break
            bases.add(cur.base)
            cur = index.get(cur.base)
    stored = {cid: c.stored for cid in needed | bases if (c := index.get(cid)) is not None}
    return sum(stored[c] for c in needed if c in stored), sum(stored[c] for c in bases)


async def _held_manifests(
    app: web.Application, store: Store, job: str, step: int
) -> dict[LocalCheckpoint, list[Manifest]]:
    """The steps of ``job`` up to ``step`` this node holds, newest first, with their
    committed manifests (a local copy was verified when it was pulled, or is the source a
    push was made from); an unreadable manifest is left out: its chunks count as missing."""
    config = app[CONFIG]
    here = [c for c in config.hot.checkpoints(job)
            if c.step <= step]  # fmt: skip
    found: dict[LocalCheckpoint, list[Manifest]] = {c: [] for c in here}
    by_step = {c.step: c for c in here}
    for part in await list_checkpoints(store, job):
        if part.step in by_step:
            try:
                found[by_step[part.step]].append(
                    await load_manifest(store, job, part.step, part.node)
                )
            except FerryError:
                continue
    return found


ROUTES = [
    web.get("/v1/checkpoints", get_checkpoints),
    web.get("/v1/pushes", get_pushes),
    web.get("/v1/estimate", get_estimate),
]
