"""Pins: on this agent and in every tier's store, with an expiry."""

from __future__ import annotations

import logging

from aiohttp import web

from agent.node.protected import check_pinnable
from agent.rpc.appkeys import CONFIG, PINS, TIERS
from agent.rpc.middleware import finite_number, json_body, parse_step, parse_step_arg, required
from transfer.errors import FerryError, StoreError
from transfer.format.names import check_name
from transfer.retention import pin, unpin

log = logging.getLogger(__name__)

MAX_PIN_SECONDS = 7 * 24 * 3600


async def post_pin(request: web.Request) -> web.Response:
    body = await json_body(request, ("job", "step", "ttl_s"))
    job = check_name("job", required(body, "job", "body field"))
    step = parse_step(required(body, "step", "body field"))
    ttl = body.get("ttl_s", 3600)
    if not finite_number(ttl, 0, MAX_PIN_SECONDS):
        raise ValueError(f"ttl_s must be within 0..{MAX_PIN_SECONDS} (pins expire)")
    # as `ferry pin`: a step that is not here nor in any tier is refused (404)
    await check_pinnable(request.app[CONFIG].hot, request.app[TIERS], job, step)
    expiry = request.app[PINS].pin(job, step, ttl)
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
    """Remove this agent's pin; ``removed`` says whether there was one (here or in a
    tier): either way the step is not pinned by this agent any more."""
    job = check_name("job", required(request.query, "job", "query parameter"))
    step = parse_step_arg(required(request.query, "step", "query parameter"))
    if step is None:
        raise ValueError("step must be a step number ('latest' is refused)")
    removed = request.app[PINS].unpin(job, step)
    for name, store in request.app[TIERS]:
        try:
            removed |= await unpin(store, job, step, _pin_holder(request.app))
        except FerryError as exc:  # the store pin expires on its own
            log.warning("could not unpin %s step %s in %s: %s", job, step, name, exc)
    return web.json_response({"job": job, "step": step, "pinned": False, "removed": removed})


ROUTES = [
    web.post("/v1/pins", post_pin),
    web.delete("/v1/pins", delete_pin),
]
