"""The agent's RPC: aiohttp, JSON, bearer-token auth on every route but /healthz.

create_app() puts the routes together (every module of agent/routes/, one per resource, each
with its ROUTES) behind the middlewares (agent/middleware.py: auth, errors to JSON 4xx); the
resources they share (stores, prefetcher, push queue, standby, retention: agent/appkeys.py)
live in a cleanup context, released exactly when start-up succeeded. docs/openapi.yaml
documents the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from agent.appkeys import (
    CONFIG,
    HOLDS,
    HOT_INDEX,
    LANDING,
    METER,
    METRICS,
    PART_SIZES,
    PEERS,
    PINS,
    PREFETCHER,
    PUSHQUEUE,
    RETENTION,
    STANDBY,
    TIERS,
    TOKEN,
)
from agent.config import AgentConfig
from agent.drain import drain_tasks
from agent.estimate import BandwidthMeter
from agent.holds import StepHolds
from agent.logs import event
from agent.metrics import Metrics
from agent.middleware import auth_middleware, error_middleware
from agent.peers import HotIndex, PeerSource
from agent.pins import LocalPins
from agent.prefetch import Prefetcher
from agent.pushqueue import PushQueue
from agent.retention import RetentionRunner
from agent.routes import route_modules
from agent.standby import Standby
from agent.watcher import watch_hot_dir
from transfer.engine.orphans import abort_orphaned_uploads
from transfer.errors import FerryError
from transfer.store import StoreOptions, open_store
from transfer.store.base import Store

log = logging.getLogger(__name__)


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
    app[PINS] = LocalPins()
    app[PART_SIZES] = {}
    app.cleanup_ctx.extend([_tiers, _peers, _services])
    app.add_routes([route for module in route_modules() for route in module.ROUTES])
    return app


async def _tiers(app: web.Application):  # type: ignore[no-untyped-def]
    """The configured stores, closed at the end (or when a later start-up step fails)."""
    config = app[CONFIG]
    options = StoreOptions.for_window(
        config.transfer.window, endpoint_url=config.endpoint_url, settings=config.store
    )
    tiers: list[tuple[str, Store]] = []
    app[TIERS] = tiers
    try:
        for url in config.tiers:
            tiers.append((url, open_store(url, options)))
        yield
    finally:
        for _, store in tiers:
            await store.close()


async def _peers(app: web.Application):  # type: ignore[no-untyped-def]
    """One client for the configured peers and for the members of fan-out restores, and
    the index of this node's hot chunks that peers ask for."""
    config = app[CONFIG]
    app[HOT_INDEX] = HotIndex(config.hot, app[TIERS])
    app[PEERS] = PeerSource(config.peers, app[TOKEN])
    try:
        yield
    finally:
        await app[PEERS].close()


async def _services(app: web.Application):  # type: ignore[no-untyped-def]
    """The push queue, prefetcher, standby replication, retention and the hot-dir watcher:
    each registers its own release as it starts, so a failed start releases exactly what
    started; a normal stop drains the running ones under one shared deadline."""
    config, tiers = app[CONFIG], app[TIERS]
    async with contextlib.AsyncExitStack() as started:
        await _abort_orphaned_uploads(config, tiers)
        queue = app[PUSHQUEUE] = PushQueue.from_config(config, tiers)
        started.callback(queue.close)
        app[HOLDS] = StepHolds()
        prefetcher = app[PREFETCHER] = _prefetcher(app, queue)
        app[LANDING] = prefetcher.landing
        standby = app[STANDBY] = Standby(
            prefetcher,
            tiers,
            hot_dir=config.hot,
            expected_nodes=config.expected_nodes,
            poll_seconds=config.standby_poll_seconds,
            jobs=config.standby_jobs,
        )
        await queue.start()
        stop = asyncio.Event()
        background: list[asyncio.Task[None]] = []
        started.push_async_callback(
            _drain, config.drain_seconds, stop, background, prefetcher, queue
        )
        watcher = watch_hot_dir(config.hot, queue.on_committed, stop=stop)
        background.append(asyncio.create_task(watcher, name="hot-dir-watcher"))
        background.append(asyncio.create_task(standby.loop(stop), name="standby"))
        if config.retention is not None:
            runner = app[RETENTION] = _retention(app, queue)
            queue.on_pushed = runner.poke
            background.append(asyncio.create_task(runner.loop(stop), name="retention"))
        yield


def _prefetcher(app: web.Application, queue: PushQueue) -> Prefetcher:
    config = app[CONFIG]
    return Prefetcher(
        config.hot,
        app[TIERS],
        config.transfer_options(),
        app[METER],
        concurrency=config.prefetch_concurrency,
        chunk_source=app[PEERS] if config.peers else None,
        fanout_client=app[PEERS],
        on_restore=queue.exclude,
        expected_nodes=config.expected_nodes,
        holds=app[HOLDS],
        pin_holder=f"prefetch-{config.node}",
        background_rate=config.standby_max_rate or None,
    )


def _retention(app: web.Application, queue: PushQueue) -> RetentionRunner:
    config, tiers = app[CONFIG], app[TIERS]
    assert config.retention is not None
    return RetentionRunner(
        config.retention,
        node=config.node,
        hot_dir=config.hot,
        tiers=tiers,
        journal=queue.journal,
        holds=app[HOLDS],
        pins=app[PINS].active,
        busy=queue.busy_steps,
        metrics=app[METRICS],
        options=config.transfer_options(),
    )


async def _abort_orphaned_uploads(config: AgentConfig, tiers: list[tuple[str, Store]]) -> None:
    if not config.orphan_upload_seconds:
        return
    for name, store in tiers:
        try:
            aborted = await abort_orphaned_uploads(store, config.orphan_upload_seconds)
        except FerryError as exc:  # a tier that is down now must not stop the agent
            log.warning("could not check %s for orphaned uploads: %s", name, exc)
            continue
        if aborted:
            event(log, "orphan_uploads_aborted", tier=name, uploads=aborted)


async def _drain(
    seconds: float,
    stop: asyncio.Event,
    background: list[asyncio.Task[None]],
    prefetcher: Prefetcher,
    queue: PushQueue,
) -> None:
    stop.set()
    await asyncio.gather(  # one shared deadline for every drain
        # the watcher returns within one poll; a retention run in progress (perhaps copying
        # a step to a colder tier) is cancelled at the deadline, which leaves every store
        # consistent
        drain_tasks(background, seconds),
        prefetcher.drain(seconds),
        queue.drain(seconds),
    )


__all__ = ["create_app"]
