"""Liveness and Prometheus metrics."""

from __future__ import annotations

import logging

from aiohttp import web

from agent.appkeys import CONFIG, METER, METRICS, PREFETCHER, PUSHQUEUE

log = logging.getLogger(__name__)


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


ROUTES = [
    web.get("/healthz", healthz),
    web.get("/metrics", metrics),
]
