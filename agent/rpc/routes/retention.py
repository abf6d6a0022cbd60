"""The last retention run's report, a dry run, or a run now."""

from __future__ import annotations

import logging

from aiohttp import web

from agent.rpc.appkeys import RETENTION
from agent.rpc.middleware import json_body

log = logging.getLogger(__name__)


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
    """Run retention now (as the schedule would) and return its report; a body of
    ``{"dry_run": true}`` plans the run and changes nothing (it was ignored: the run was
    real)."""
    body = await json_body(request, ("dry_run",)) if request.can_read_body else {}
    if not isinstance(body.get("dry_run", False), bool):
        raise ValueError('the body must be empty or {"dry_run": true|false}')
    runner = request.app.get(RETENTION)
    if runner is None:  # (a 409: the agent's config is in the way; it was a 404 whose error
        # type said a checkpoint was not found)
        raise web.HTTPConflict(reason="retention is not configured on this agent ([retention] "
                               "in its config)")  # fmt: skip
    return web.json_response(await runner.run_once(dry_run=body.get("dry_run", False)))


ROUTES = [
    web.get("/v1/retention", get_retention),
    web.post("/v1/retention/run", post_retention_run),
]
