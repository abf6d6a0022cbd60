"""Liveness and Prometheus metrics."""

from __future__ import annotations

import logging

from aiohttp import web

from agent.node.prefetch import State
from agent.rpc.appkeys import CONFIG, METER, METRICS, PREFETCHER, PUSHQUEUE

log = logging.getLogger(__name__)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "node": request.app[CONFIG].node})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    prefetcher = request.app[PREFETCHER]
    m.set("ferry_prefetch_queue_depth", prefetcher.active())
    # every state, 0 included: a state no record is in now must not keep its old count
    by_state = dict.fromkeys(State, 0)
    for job in prefetcher.jobs.values():
        by_state[job.state] += 1
    for state, count in by_state.items():
        m.set("ferry_prefetch_total", count, state=state.value)
    # counters over the agent's life, not over the records it still remembers (the oldest
    # finished ones are forgotten: Prefetcher.HISTORY), so they never go down
    m.set("ferry_prefetch_seconds_total", prefetcher.finished_seconds)
    for source, nbytes in prefetcher.bytes_moved().items():
        m.set("ferry_prefetch_bytes_total", nbytes, source=source, direction="in")
    request.app[PUSHQUEUE].publish(m)
    for source, rate in request.app[METER].snapshot().items():
        m.set("ferry_bandwidth_bytes_per_second", float(rate), source=source)
    return web.Response(text=m.render(), content_type="text/plain")


ROUTES = [
    web.get("/healthz", healthz),
    web.get("/metrics", metrics),
]
