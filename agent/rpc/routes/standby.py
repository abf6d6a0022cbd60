"""Standby replication: which jobs this node copies each new durable step of."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from agent.rpc.appkeys import CONFIG, STANDBY, TIERS
from agent.rpc.middleware import json_body, parse_layout
from transfer.engine.catalog import Catalog
from transfer.errors import FerryError
from transfer.store.base import Store

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
    job = request.match_info["job"]
    entry = request.app[STANDBY].register(job, layout=layout)
    entry.warning = None
    if not await _any_step(request.app[TIERS], job):  # a typo, or a job yet to save
        entry.warning = (
            f"no step of job {job!r} in any tier yet: it is watched for its first "
            "(check the name if the job has saved)"
        )
        log.warning("standby %s: %s", job, entry.warning)
    return web.json_response(entry.to_dict())


#: how long the registration's check for a step of the job may take (the scheduler's
#: client waits 30 s; a tier that does not answer is retried for longer than that)
_CHECK_SECONDS = 5.0


async def _any_step(tiers: list[tuple[str, Store]], job: str) -> bool:
    """Whether some tier holds a step of ``job`` (one listing per tier, until one does);
    a tier that cannot be listed in time counts as holding one (no warning on a guess)."""
    try:
        async with asyncio.timeout(_CHECK_SECONDS):
            for _, store in tiers:
                if await Catalog(store).steps(job):
                    return True
    except (FerryError, OSError, TimeoutError):
        return True
    return False


async def delete_standby(request: web.Request) -> web.Response:
    job = request.match_info["job"]
    removed = request.app[STANDBY].unregister(job)
    return web.json_response({"job": job, "removed": removed})


ROUTES = [
    web.get("/v1/standby", get_standby),
    web.put("/v1/standby/{job}", put_standby),
    web.delete("/v1/standby/{job}", delete_standby),
]
