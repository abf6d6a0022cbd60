"""The agent's RPC: aiohttp, JSON, bearer-token auth on every route but /healthz.

create_app() builds the application from a config; resources (stores, the prefetcher) live
in a cleanup context so they are released exactly when startup succeeded. Domain errors map
to JSON 4xx in one middleware; auth is another. docs/openapi.yaml documents the routes.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from agent.config import AgentConfig
from agent.drain import drain_tasks
from agent.holdings import local_checkpoints
from agent.holds import StepHolds
from agent.logs import event
from agent.metrics import Metrics
from agent.peers import ENCODING_HEADER, HotIndex, PeerSource, encode_for_peer
from agent.prefetch import FINAL, Prefetcher, State
from agent.pushqueue import PushQueue
from agent.retention import RetentionRunner
from agent.standby import Standby
from agent.watcher import watch_hot_dir
from transfer.engine import list_checkpoints, resolve_manifests
from transfer.engine.catalog import (
    CheckpointInfo,
    is_complete,
    latest_complete_step,
    load_manifest,
    open_catalog,
)
from transfer.engine.estimate import BandwidthMeter, estimate_migration
from transfer.engine.orphans import abort_orphaned_uploads
from transfer.errors import (
    AccessDeniedError,
    CheckpointNotFoundError,
    DestinationError,
    FerryError,
    FormatError,
    StoreError,
)
from transfer.format.chunkid import is_chunk_id
from transfer.format.names import check_name, check_step
from transfer.retention import pin, unpin
from transfer.store import StoreOptions, open_store
from transfer.store.base import Store

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", AgentConfig)
TOKEN = web.AppKey("token", str)
TIERS = web.AppKey("tiers", list)
PREFETCHER = web.AppKey("prefetcher", Prefetcher)
METER = web.AppKey("meter", BandwidthMeter)
METRICS = web.AppKey("metrics", Metrics)
PINS = web.AppKey("pins", dict)
PART_SIZES = web.AppKey("part_sizes", dict)
PUSHQUEUE = web.AppKey("pushqueue", PushQueue)
HOLDS = web.AppKey("holds", StepHolds)
RETENTION = web.AppKey("retention", RetentionRunner)
HOT_INDEX = web.AppKey("hot_index", HotIndex)
STANDBY = web.AppKey("standby", Standby)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_PIN_SECONDS = 7 * 24 * 3600


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": message, "type": kind}, status=status)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path != "/healthz":
        expected = request.app[TOKEN]
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected.encode()):
            return _error(401, "missing or wrong bearer token", "Unauthorized")
    return await handler(request)


_STATUS = [
    (CheckpointNotFoundError, 404),
    (DestinationError, 409),
    (FormatError, 400),
    (AccessDeniedError, 502),
    (StoreError, 502),
    (FerryError, 400),
]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json":
            raise
        response = _error(exc.status, exc.reason, type(exc).__name__)
        if "Allow" in exc.headers:  # 405 must say what is allowed
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (FerryError, ValueError) as exc:
        status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 400)
        return _error(status, " ".join(str(exc).split()), type(exc).__name__)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("request body is not JSON") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def _finite_number(value: object, low: float, high: float) -> bool:
    """A real JSON number (not a bool, NaN or infinity) in (low, high]."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low < value <= high
    )


def _step(value: object) -> int:
    """A step number; 120.0 is one too (JSON Schema's integers include integral floats)."""
    if isinstance(value, float) and value.is_integer() and 0 <= value < 1e18:
        value = int(value)
    return check_step(value)


def _step_arg(value: object) -> int | None:
    """A step number, or None for 'latest'."""
    if value in (None, "latest"):
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return _step(value)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "node": request.app[CONFIG].node})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    prefetcher = request.app[PREFETCHER]
    m.set("ferry_prefetch_queue_depth", prefetcher.active())
    by_state: dict[str, int] = {}
    seconds = 0.0
    moved: dict[str, int] = {}
    for job in prefetcher.jobs.values():
        by_state[job.state.value] = by_state.get(job.state.value, 0) + 1
        if job.started and job.finished:
            seconds += job.finished - job.started
        for source, nbytes in job.bytes_by_source.items():
            moved[source] = moved.get(source, 0) + nbytes
    for state, count in by_state.items():
        m.set("ferry_prefetch_total", count, state=state)
    m.set("ferry_prefetch_seconds_total", seconds)
    for source, nbytes in moved.items():
        m.set("ferry_prefetch_bytes_total", nbytes, source=source, direction="in")
    request.app[PUSHQUEUE].publish(m)
    for source, rate in request.app[METER].snapshot().items():
        m.set("ferry_bandwidth_bytes_per_second", float(rate), source=source)
    return web.Response(text=m.render(), content_type="text/plain")


async def post_prefetch(request: web.Request) -> web.Response:
    body = await _json_body(request)
    job = check_name("job", body.get("job"))
    step = _step_arg(body.get("step", "latest"))
    deadline = body.get("deadline_s")
    if deadline is not None and not _finite_number(deadline, 0, 7 * 24 * 3600):
        raise ValueError("deadline_s must be a number of seconds in (0, 604800]")
    record = request.app[PREFETCHER].submit(job, step, deadline)
    request.app[METRICS].inc("ferry_prefetch_started_total")
    return web.json_response({"id": record.id}, status=202)


async def get_prefetch(request: web.Request) -> web.Response:
    record = request.app[PREFETCHER].jobs.get(request.match_info["id"])
    if record is None:
        raise web.HTTPNotFound(reason="no such prefetch")
    return web.json_response(record.to_dict())


async def delete_prefetch(request: web.Request) -> web.Response:
    record = request.app[PREFETCHER].cancel(request.match_info["id"])
    if record is None:
        raise web.HTTPNotFound(reason="no such prefetch")
    if record.task is not None and not record.task.done():
        await record.task  # the job records its own cancellation; staging is cleaned up
    return web.json_response(record.to_dict())


async def get_chunk(request: web.Request) -> web.Response:
    """A chunk from this node's hot data, for peer agents (hash-checked first): raw, or
    encoded against ``?base=<chunk id>`` when this node holds that chunk too."""
    cid = request.match_info["id"]
    base = request.query.get("base")
    if not is_chunk_id(cid) or (base is not None and not is_chunk_id(base)):
        raise ValueError("not a chunk id")
    level = request.app[CONFIG].transfer_options().zstd_level
    found = await encode_for_peer(request.app[HOT_INDEX], cid, base, level)
    if found is None:
        raise web.HTTPNotFound(reason="this node does not hold that chunk")
    enc, payload = found
    request.app[METRICS].inc("ferry_bytes_total", len(payload), direction="out", source="peer")
    return web.Response(
        body=payload, content_type="application/octet-stream", headers={ENCODING_HEADER: enc}
    )


async def get_standby(request: web.Request) -> web.Response:
    """The jobs this node is a standby for, and what it replicated."""
    standby = request.app[STANDBY]
    doc = {"node": request.app[CONFIG].node, "jobs": [e.to_dict() for e in standby.jobs.values()]}
    return web.json_response(doc)


async def put_standby(request: web.Request) -> web.Response:
    """Make this node a standby for a job: each new durable step is copied here at once."""
    entry = request.app[STANDBY].register(request.match_info["job"])
    return web.json_response(entry.to_dict())


async def delete_standby(request: web.Request) -> web.Response:
    job = request.match_info["job"]
    removed = request.app[STANDBY].unregister(job)
    return web.json_response({"job": job, "removed": removed})


async def get_pushes(request: web.Request) -> web.Response:
    """Background pushes of this node's checkpoints: staged, durable per tier, or failed."""
    queue = request.app[PUSHQUEUE]
    return web.json_response({"node": request.app[CONFIG].node, "pushes": queue.states()})


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
        for held in local_checkpoints(config.hot_dir, job, config.commit_marker):
            if held.step in steps:
                steps[held.step]["local"] = True
                steps[held.step]["replica"] = prefetcher.is_replica(job, held.step)
        for entry in steps.values():
            # complete = the create-only marker the last node's push wrote (not a count of
            # manifests: a node may still be uploading a part nobody has listed yet)
            entry["complete"] = any(
                [await is_complete(store, job, entry["step"], config.expected_nodes)
                 for name, store in readable if name in entry["tiers"]]
            )  # fmt: skip
            entry["pinned"] = _pinned(request.app, job, entry["step"])
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


async def get_estimate(request: web.Request) -> web.Response:
    query = request.query
    job = check_name("job", query.get("job"))
    step = _step_arg(query.get("step", "latest"))
    gpus = int(query.get("gpus", "1"))
    price = float(query.get("gpu_hour_price", "0"))
    if not 0 <= gpus <= 1_000_000 or not (math.isfinite(price) and 0 <= price <= 1e6):
        raise ValueError("gpus must be in 0..1000000 and gpu_hour_price a price in 0..1e6")
    config = request.app[CONFIG]
    unreachable: list[str] = []
    for name, store in request.app[TIERS]:
        try:
            wanted = step
            if wanted is None and config.expected_nodes:
                wanted = await latest_complete_step(store, job, config.expected_nodes)
            manifests = await resolve_manifests(store, job, wanted)
            held_ids = await _held_chunk_ids(request.app, store, job, manifests[0].step)
        except CheckpointNotFoundError:
            continue
        except StoreError as exc:  # the next tier may answer (as a prefetch would use it)
            unreachable.append(f"{name}: {' '.join(str(exc).split())}")
            continue
        needed: dict[str, int] = {}
        total = 0
        for m in manifests:
            for f in m.files:
                total += f.size
                for c in f.chunks:
                    if c.id not in held_ids:
                        needed[c.id] = c.stored
        missing = sum(needed.values())
        est = estimate_migration(
            {f"tier:{name}": missing},
            request.app[METER],
            bytes_total=total,
            gpus=gpus,
            gpu_hour_price=price,
        )
        doc = est.to_dict()
        doc.update(job=job, step=manifests[0].step, node=config.node, source=f"tier:{name}")
        return web.json_response(doc)
    which = "latest" if step is None else str(step)
    if unreachable:
        raise StoreError(
            f"no reachable tier holds job {job!r} step {which}; " + "; ".join(unreachable)
        )
    raise CheckpointNotFoundError(f"no tier holds job {job!r} step {which}")


async def _held_chunk_ids(app: web.Application, store: Store, job: str, step: int) -> set[str]:
    """Chunk ids of the checkpoints of ``job`` up to ``step`` that this node holds, as their
    committed manifests describe them (a local copy was verified when it was pulled, or is
    the source a push was made from)."""
    config = app[CONFIG]
    held = {c.step for c in local_checkpoints(config.hot_dir, job, config.commit_marker)}
    ids: set[str] = set()
    for c in await list_checkpoints(store, job):
        if c.step in held and c.step <= step:
            try:
                manifest = await load_manifest(store, job, c.step, c.node)
            except FerryError:
                continue  # unreadable: count its chunks as missing
            ids.update(chunk.id for chunk in manifest.all_chunks())
    return ids


def _pinned(app: web.Application, job: str, step: int) -> bool:
    expiry = app[PINS].get((job, step))
    return expiry is not None and expiry > time.time()


async def post_pin(request: web.Request) -> web.Response:
    body = await _json_body(request)
    job = check_name("job", body.get("job"))
    step = _step(body.get("step"))
    ttl = body.get("ttl_s", 3600)
    if not _finite_number(ttl, 0, MAX_PIN_SECONDS):
        raise ValueError(f"ttl_s must be within 0..{MAX_PIN_SECONDS} (pins expire)")
    expiry = time.time() + ttl
    request.app[PINS][(job, step)] = expiry
    # In every tier's store too, so that no node's retention deletes it there. A pin that
    # did not reach a tier is an error: the caller must not rely on it.
    failed = []
    for name, store in request.app[TIERS]:
        try:
            await pin(store, job, step, _pin_holder(request.app), ttl)
        except FerryError as exc:
            failed.append(f"{name}: {exc}")
    if failed:
        raise StoreError("pinned on this node, but not in every tier: " + "; ".join(failed))
    return web.json_response({"job": job, "step": step, "expires_at": expiry}, status=201)


def _pin_holder(app: web.Application) -> str:
    return f"rpc-{app[CONFIG].node}"


async def delete_pin(request: web.Request) -> web.Response:
    job = check_name("job", request.query.get("job"))
    step = _step_arg(request.query.get("step"))
    if step is None:
        raise ValueError("step is required")
    request.app[PINS].pop((job, step), None)
    for name, store in request.app[TIERS]:
        try:
            await unpin(store, job, step, _pin_holder(request.app))
        except FerryError as exc:  # the store pin expires on its own
            log.warning("could not unpin %s step %s in %s: %s", job, step, name, exc)
    return web.json_response({"job": job, "step": step, "pinned": False})


def _active_pins(app: web.Application) -> set[tuple[str, int]]:
    now = time.time()
    return {key for key, expiry in app[PINS].items() if expiry > now}


async def get_retention(request: web.Request) -> web.Response:
    """The last retention run's report; ``?dry_run=1`` plans one now and changes nothing."""
    dry_run = request.query.get("dry_run", "0")
    if dry_run not in ("0", "1", "true", "false"):  # as the spec says, enabled or not
        raise ValueError("dry_run must be one of 0, 1, true, false")
    runner = request.app.get(RETENTION)
    if runner is None:
        return web.json_response({"enabled": False})
    if dry_run in ("1", "true"):
        return web.json_response({"enabled": True, **await runner.run_once(dry_run=True)})
    return web.json_response({"enabled": True, "last": runner.last})


async def post_retention_run(request: web.Request) -> web.Response:
    """Run retention now (as the schedule would) and return its report."""
    runner = request.app.get(RETENTION)
    if runner is None:
        raise CheckpointNotFoundError("retention is not configured ([retention] in the config)")
    return web.json_response(await runner.run_once())


def create_app(config: AgentConfig, token: str) -> web.Application:
    if not token:
        raise ValueError("the RPC needs a non-empty bearer token")
    app = web.Application(
        middlewares=[error_middleware, auth_middleware], client_max_size=config.max_body_bytes
    )
    app[CONFIG] = config
    app[TOKEN] = token
    app[METER] = BandwidthMeter()
    app[METRICS] = Metrics()
    app[PINS] = {}
    app[PART_SIZES] = {}
    app.cleanup_ctx.append(_resources)
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/metrics", metrics),
            web.post("/v1/prefetch", post_prefetch),
            web.get("/v1/prefetch/{id}", get_prefetch),
            web.delete("/v1/prefetch/{id}", delete_prefetch),
            web.get("/v1/checkpoints", get_checkpoints),
            web.get("/v1/pushes", get_pushes),
            web.get("/v1/chunks/{id}", get_chunk),
            web.get("/v1/estimate", get_estimate),
            web.post("/v1/pins", post_pin),
            web.delete("/v1/pins", delete_pin),
            web.get("/v1/retention", get_retention),
            web.post("/v1/retention/run", post_retention_run),
            web.get("/v1/standby", get_standby),
            web.put("/v1/standby/{job}", put_standby),
            web.delete("/v1/standby/{job}", delete_standby),
        ]
    )
    return app


async def _resources(app: web.Application):  # type: ignore[no-untyped-def]
    config = app[CONFIG]
    options = StoreOptions(endpoint_url=config.endpoint_url)
    tiers = [(url, open_store(url, options)) for url in config.tiers]
    app[TIERS] = tiers
    app[HOT_INDEX] = HotIndex(config.hot_dir, config.commit_marker, tiers)
    peers = PeerSource(config.peers, app[TOKEN]) if config.peers else None
    queue = app[PUSHQUEUE] = PushQueue.from_config(config, tiers)
    holds = app[HOLDS] = StepHolds()
    app[PREFETCHER] = Prefetcher(
        config.hot_dir,
        config.commit_marker,
        tiers,
        config.transfer_options(),
        app[METER],
        concurrency=config.prefetch_concurrency,
        chunk_source=peers,
        on_restore=queue.exclude,
        expected_nodes=config.expected_nodes,
        holds=holds,
        pin_holder=f"prefetch-{config.node}",
        background_rate=config.standby_max_rate or None,
    )
    standby = app[STANDBY] = Standby(
        app[PREFETCHER],
        tiers,
        hot_dir=config.hot_dir,
        commit_marker=config.commit_marker,
        expected_nodes=config.expected_nodes,
        poll_seconds=config.standby_poll_seconds,
        jobs=config.standby_jobs,
    )
    if config.orphan_upload_seconds:
        for name, store in tiers:
            try:
                aborted = await abort_orphaned_uploads(store, config.orphan_upload_seconds)
            except FerryError as exc:  # a tier that is down now must not stop the agent
                log.warning("could not check %s for orphaned uploads: %s", name, exc)
                continue
            if aborted:
                event(log, "orphan_uploads_aborted", tier=name, uploads=aborted)
    await queue.start()
    stop = asyncio.Event()
    background = [
        asyncio.create_task(
            watch_hot_dir(config.hot_dir, config.commit_marker, queue.on_committed, stop=stop),
            name="hot-dir-watcher",
        ),
        asyncio.create_task(standby.loop(stop), name="standby"),
    ]
    if config.retention is not None:
        runner = app[RETENTION] = RetentionRunner(
            config.retention,
            node=config.node,
            hot_dir=config.hot_dir,
            commit_marker=config.commit_marker,
            tiers=tiers,
            journal=queue.journal,
            holds=holds,
            pins=functools.partial(_active_pins, app),
            busy=queue.busy_steps,
            metrics=app[METRICS],
        )
        queue.on_pushed = runner.poke
        background.append(asyncio.create_task(runner.loop(stop), name="retention"))
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(  # one shared deadline for every drain
            # the watcher returns within one poll; a retention run in progress (perhaps
            # copying a step to a colder tier) is cancelled at the deadline, which leaves
            # every store consistent
            drain_tasks(background, config.drain_seconds),
            app[PREFETCHER].drain(config.drain_seconds),
            queue.drain(config.drain_seconds),
        )
        queue.close()
        if peers is not None:
            await peers.close()
        for _, store in tiers:
            await store.close()


__all__ = ["FINAL", "State", "create_app"]
