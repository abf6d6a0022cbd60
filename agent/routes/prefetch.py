"""Scheduler-requested pulls into this node's hot dir."""

from __future__ import annotations

import logging

from aiohttp import web

from agent.appkeys import METRICS, PREFETCHER
from agent.middleware import finite_number, json_body, parse_step_arg
from transfer.format.names import check_name

log = logging.getLogger(__name__)


async def post_prefetch(request: web.Request) -> web.Response:
    body = await json_body(request)
    job = check_name("job", body.get("job"))
    step = parse_step_arg(body.get("step", "latest"))
    deadline = body.get("deadline_s")
    if deadline is not None and not finite_number(deadline, 0, 7 * 24 * 3600):
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


ROUTES = [
    web.post("/v1/prefetch", post_prefetch),
    web.get("/v1/prefetch/{id}", get_prefetch),
    web.delete("/v1/prefetch/{id}", delete_prefetch),
]
