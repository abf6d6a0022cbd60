"""Standby replication: which jobs this node copies each new durable step of."""

from __future__ import annotations

import logging

from aiohttp import web

from agent.rpc.appkeys import CONFIG, STANDBY
from agent.rpc.middleware import json_body, parse_layout

log = logging.getLogger(__name__)


async def get_standby(request: web.Request) -> web.Response:
    """The jobs this node is a standby for, and what it replicated."""
    standby = request.app[STANDBY]
    doc = {"node": request.app[CONFIG].node, "jobs": standby.describe()}
    return web.json_response(doc)


async def put_standby(request: web.Request) -> web.Response:
    """Make this node a standby for a job: each new durable step is copied here at once
    (with a ``layout`` body, only the share those ranks will read)."""
    body = await json_body(request, ("layout",)) if request.can_read_body else {}
    layout = parse_layout(body.get("layout"))
    entry = request.app[STANDBY].register(request.match_info["job"], layout=layout)
    return web.json_response(entry.to_dict())


async def delete_standby(request: web.Request) -> web.Response:
    job = request.match_info["job"]
    removed = request.app[STANDBY].unregister(job)
    return web.json_response({"job": job, "removed": removed})


ROUTES = [
    web.get("/v1/standby", get_standby),
    web.put("/v1/standby/{job}", put_standby),
    web.delete("/v1/standby/{job}", delete_standby),
]
