"""The agent's RPC: aiohttp, JSON, bearer-token auth on every route but /healthz.

create_app() puts the routes together (every module of agent/rpc/routes/, one per resource, each
with its ROUTES) behind the middlewares (agent/rpc/middleware.py: auth, errors to JSON 4xx); the
resources they share (stores, prefetcher, push queue, standby, retention: agent/rpc/appkeys.py)
live in a cleanup context, released exactly when start-up succeeded. docs/openapi.yaml
documents the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from agent.daemon.config import AgentConfig
from agent.daemon.logs import event
from agent.node.estimate import BandwidthMeter
from agent.node.hotdir import AgentLock
from agent.node.prefetch import Prefetcher, PrefetchLinks, PrefetchPolicy
from agent.node.protected import LocalPins, ProtectedSteps, StepHolds
from agent.node.pushqueue import PushQueue
from agent.node.retention_loop import RetentionRunner
from agent.node.standby import Standby
from agent.node.watcher import watch_hot_dir
from agent.peers.chunks import HotIndex, PeerSource
from agent.rpc.appkeys import (
    CHUNK_CLIENTS,
    CONFIG,
    CREDENTIALS,
    HOLDS,
    HOT_INDEX,
    LANDING,
    LOCAL_PULLS,
    METER,
    METRICS,
    PART_SIZES,
    PEERS,
    PINS,
    PREFETCH_WAITERS,
    PREFETCHER,
    PUSHQUEUE,
    REFUSALS,
    RETENTION,
    STANDBY,
    STOPPING,
    TIERS,
    TLS,
)
from agent.rpc.auth import Credentials, Refusals, SecretFile
from agent.rpc.limits import CHUNK_REQUESTS_PER_CLIENT, WAITS_PER_CLIENT, DestLocks, InFlight
from agent.rpc.metrics import Metrics
from agent.rpc.middleware import auth_middleware, error_middleware
from agent.rpc.routes import route_modules
from agent.rpc.services import Services
from agent.rpc.tls import AgentTls
from transfer.directio import KEPT_BUFFERS_MAX, POOL
from transfer.engine.catalog import require_store
from transfer.engine.orphans import abort_orphaned_uploads
from transfer.errors import FerryError, NotAStoreError, StoreError
from transfer.store import StoreOptions, open_store
from transfer.store.base import Store

log = logging.getLogger(__name__)


def create_app(config: AgentConfig, token: str) -> web.Application:
    """``token``: the main token (config's ``token_file``, when set, is read again whenever
    it changes). TlsError when the TLS files do not load."""
    if not token:
        raise ValueError("the RPC needs a non-empty bearer token")
    app = web.Application(
        middlewares=[error_middleware, auth_middleware], client_max_size=config.max_body_bytes
    )
    app[CONFIG] = config
    app[CREDENTIALS] = _credentials(config, token)
    app[REFUSALS] = Refusals()
    app[CHUNK_CLIENTS] = InFlight(CHUNK_REQUESTS_PER_CLIENT)
    app[PREFETCH_WAITERS] = InFlight(WAITS_PER_CLIENT)
    app[STOPPING] = asyncio.Event()
    app[LOCAL_PULLS] = DestLocks()
    app.on_shutdown.append(_stopping)  # before aiohttp waits for the requests in flight
    app[TLS] = AgentTls(
        config.tls_cert_file,
        config.tls_key_file,
        config.tls_ca_file,
        client_auth=config.tls_client_auth,
    )
    app[METER] = BandwidthMeter()
    app[METRICS] = Metrics()
    app[PINS] = LocalPins()
    app[PART_SIZES] = {}
    app.cleanup_ctx.extend([_hot_dir_lock, _tiers, _peers, _services])
    app.add_routes([route for module in route_modules() for route in module.ROUTES])
    return app


def _credentials(config: AgentConfig, token: str) -> Credentials:
    main = SecretFile(config.token_file, "token_file") if config.token_file else token
    peer = config.peer_token_file
    return Credentials(main, SecretFile(peer, "peer_token_file") if peer else None)


async def _hot_dir_lock(app: web.Application):  # type: ignore[no-untyped-def]
    """One agent per hot dir, first of all: a second agent on it stops here, before it
    opens a store or the journal or touches the hot dir (agent/node/hotdir.py's AgentLock)."""
    config = app[CONFIG]
    holder = f"pid {os.getpid()}, node {config.node}, listening on {config.listen}"
    made = not await asyncio.to_thread(config.hot_dir.is_dir)
    lock = await asyncio.to_thread(AgentLock.acquire, config.hot_dir, holder)
    if made:  # (a typo'd path would be watched, empty, while training saves elsewhere)
        log.warning("hot_dir %s did not exist: made it (training must save there: is the "
                    "path right?)", config.hot_dir)  # fmt: skip
    try:
        yield
    finally:
        lock.release()


async def _tiers(app: web.Application):  # type: ignore[no-untyped-def]
    """The configured stores, closed at the end (or when a later start-up step fails).
    Each must be a ckpt-ferry store already: the agent never makes one (``ferry init``)."""
    config = app[CONFIG]
    options = store_options(config)
    tiers: list[tuple[str, Store]] = []
    app[TIERS] = tiers
    try:
        for url in config.tiers:
            tiers.append((url, open_store(url, options)))
        for url, store in tiers:
            await _check_tier(url, store)
        yield
    finally:
        for _, store in tiers:
            await store.close()


def store_options(config: AgentConfig) -> StoreOptions:
    """The tiers' store options: the pool fits the window the agent's transfers run with
    (``memory_mib`` may leave fewer parts in flight than the configured window)."""
    return StoreOptions.for_window(
        config.transfer_options().window, endpoint_url=config.endpoint_url, settings=config.store
    )


async def _peers(app: web.Application):  # type: ignore[no-untyped-def]
    """One client for the configured peers and for the members of fan-out restores, and
    the index of this node's hot chunks that peers ask for."""
    config = app[CONFIG]
    app[HOT_INDEX] = HotIndex(config.hot, app[TIERS])
    app[PEERS] = PeerSource(
        config.peers, app[CREDENTIALS].for_peers, tls=app[TLS], node=config.node
    )
    try:
        yield
    finally:
        await app[PEERS].close()


async def _services(app: web.Application):  # type: ignore[no-untyped-def]
    """The push queue, prefetcher, standby replication, retention and the hot-dir watcher,
    every one of their tasks owned by one TaskGroup (agent/rpc/services.py, which documents the
    shutdown order): a failed start releases exactly what started; a normal stop drains the
    running ones under one shared deadline, cancels the rest and awaits them all, then
    closes the journal."""
    config, tiers = app[CONFIG], app[TIERS]
    async with contextlib.AsyncExitStack() as started:
        await _abort_orphaned_uploads(config, tiers)
        queue = app[PUSHQUEUE] = PushQueue.from_config(config, tiers)
        started.callback(queue.close)
        services = await started.enter_async_context(Services(config.drain_seconds))
        stop = services.stop
        app[HOLDS] = StepHolds()
        # a finished restore's buffers wait for the next (up to one transfer's budget, and
        # at most what the daemonset's memory limit leaves room for: deploy/daemonset.yaml)
        POOL.max_idle = min(config.transfer_options().memory_estimate(), KEPT_BUFFERS_MAX)
        prefetcher = app[PREFETCHER] = _prefetcher(app, queue, services)
        app[LANDING] = prefetcher.landing
        # the hot dir's write rate, before the first estimate needs it (a quarter second)
        services.spawn(prefetcher.measure_disk(), name="disk-probe")
        standby = app[STANDBY] = Standby(
            prefetcher,
            tiers,
            hot_dir=config.hot,
            expected_nodes=config.expected_nodes,
            poll_seconds=config.standby_poll_seconds,
            jobs=config.standby_jobs,
            memory_limit=config.standby_memory,
        )
        # at the stop: no new push; the current one has until the deadline, then is cancelled
        services.on_drain(queue.drain)
        await queue.start(services.spawn)
        watcher = watch_hot_dir(config.hot, queue.on_committed, stop=stop)
        services.spawn(watcher, name="hot-dir-watcher")  # returns within one poll of the stop
        services.spawn(_after_probe(prefetcher, standby.loop(stop)), name="standby")
        if config.retention is not None:
            runner = app[RETENTION] = _retention(app, queue)
            queue.on_pushed = runner.poke
            # a run in progress (perhaps copying a step to a colder tier) is cancelled at the
            # deadline, which leaves every store consistent
            services.spawn(runner.loop(stop), name="retention")
        yield


async def _after_probe(prefetcher: Prefetcher, then: Coroutine[Any, Any, None]) -> None:
    """``then``, once the start-up write probe has ended: a standby's first copy beside the
    probe slowed it (the write path chosen from it: agent/node/prefetch.py), and would have
    been written before the way was chosen."""
    await prefetcher.measure_disk()  # (waits for the probe running; once done, returns)
    await then


async def _stopping(app: web.Application) -> None:
    app[STOPPING].set()


def _prefetcher(app: web.Application, queue: PushQueue, services: Services) -> Prefetcher:
    config = app[CONFIG]
    return Prefetcher(
        config.hot,
        app[TIERS],
        config.transfer_options(),
        app[METER],
        PrefetchPolicy(
            concurrency=config.prefetch_concurrency,
            expected_nodes=config.expected_nodes,
            pin_holder=f"prefetch-{config.node}",
            background_rate=config.standby_max_rate or None,
        ),
        PrefetchLinks(
            chunk_source=app[PEERS] if config.peers else None,
            fanout_client=app[PEERS],
            on_restore=queue.exclude,
            holds=app[HOLDS],
            spawn=services.spawn,
            own_part=queue.keep_own_part,
            step_changed=app[HOT_INDEX].forget_step,
        ),
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
        protected=ProtectedSteps(app[HOLDS], pins=app[PINS].active, busy=queue.busy_steps),
        metrics=app[METRICS],
        options=config.transfer_options(),
    )


async def _check_tier(url: str, store: Store) -> None:
    """Refuse to start on a tier that answers it is not a store (an empty mount point, a
    typo'd prefix, a directory for something else: no descriptor there): the agent writes
    only into stores made on purpose, and its pushes never make one (``create_store=False``,
    so a tier that becomes reachable later is refused by each push instead). A tier that
    cannot be asked now (down, denied, its directory or bucket missing: an NFS mount not
    there yet) does not stop the agent: it is logged, and the other tiers serve."""
    try:
        await require_store(store)
    except NotAStoreError as exc:
        raise NotAStoreError(f"tier {exc}") from None
    except StoreError as exc:
        log.warning("could not check that tier %s is a ckpt-ferry store: %s", url, exc)


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


__all__ = ["create_app"]
