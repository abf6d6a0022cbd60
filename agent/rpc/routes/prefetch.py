"""Scheduler-requested pulls into this node's hot dir."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from agent.node.prefetch import FINAL, PrefetchJob
from agent.rpc import limits
from agent.rpc.appkeys import METRICS, PREFETCH_WAITERS, PREFETCHER, STOPPING
from agent.rpc.middleware import (
    finite_number,
    json_body,
    parse_layout,
    parse_step_arg,
    query_seconds,
    required,
)
from transfer.format.names import check_name

log = logging.getLogger(__name__)


#: members of one fan-out restore (each asks the others for their shares)
MAX_FANOUT = 64
_PREFETCH_FIELDS = ("job", "step", "deadline_s", "fanout", "layout", "items")


async def post_prefetch(request: web.Request) -> web.Response:
    if request.app[PREFETCHER].active() >= limits.MAX_PREFETCHES:  # before reading the body
        return limits.too_many(f"{limits.MAX_PREFETCHES} prefetches queued or running already")
    body = await json_body(request, _PREFETCH_FIELDS)
    job = check_name("job", required(body, "job", "body field"))
    step = parse_step_arg(body.get("step", "latest"))
    deadline = body.get("deadline_s")
    if deadline is not None and not finite_number(deadline, 0, 7 * 24 * 3600):
        raise ValueError("deadline_s must be a number of seconds in (0, 604800]")
    group = _fanout(body.get("fanout"))
    layout, items = _share(body.get("layout"), body.get("items"))
    record = request.app[PREFETCHER].submit(
        job, step, deadline, layout=layout, items=items,
        fanout=group[:2] if group else None, fanout_layouts=group[2] if group else None,
    )  # fmt: skip
    request.app[METRICS].inc("ferry_prefetch_started_total")
    return web.json_response({"id": record.id}, status=202)


def _share(layout: object, items: object) -> tuple[dict[str, Any] | None, list[Any] | None]:
    """``layout: {"world_size": W, "ranks": [...]}`` (the share those ranks read) or
    ``items: [{path, offset, length}, ...]`` (an explicit one), in the shape the spec gives;
    (None, None): the whole step. A rank outside the world is a 404 now (parse_layout);
    what else the shape cannot say (an item's bad path) fails the prefetch when it runs, as
    the spec says of every other failure."""
    if layout is not None and items is not None:
        raise ValueError("give layout or items, not both: items names the share itself")
    if items is not None and not isinstance(items, list):
        raise ValueError("items must be a list of {path, offset, length}")
    return parse_layout(layout), items


def _fanout(value: object) -> tuple[tuple[str, ...], str, dict[str, Any]] | None:
    """``{"members": [the group's agent URLs], "me": this agent's URL, "layouts": {URL:
    layout}}`` (``me`` may be among the members or not; ``layouts``, optional: the share
    each member prefetches, absent or null for the whole step) as (the group, me,
    layouts), or None."""
    if value is None:
        return None
    if not isinstance(value, dict) or not {"members", "me"} <= set(value) <= _FANOUT_KEYS:
        raise ValueError(
            'fanout must be {"members": [agent URLs], "me": this agent\'s URL, "layouts": '
            "{URL: layout}}"
        )
    members, me = value["members"], value["me"]
    if (
        not isinstance(members, list)
        or not 1 <= len(members) <= MAX_FANOUT
        or not all(isinstance(m, str) and _is_agent_url(m) for m in members)
        or len(set(members)) != len(members)
    ):
        raise ValueError(f"fanout.members must be 1..{MAX_FANOUT} distinct http(s) agent URLs")
    if not isinstance(me, str) or not _is_agent_url(me):
        raise ValueError("fanout.me must be this agent's http(s) URL")
    group = dict.fromkeys(m.rstrip("/") for m in [*members, me])  # me may be listed or not
    return tuple(group), me.rstrip("/"), _layouts(value.get("layouts"))


_FANOUT_KEYS = {"members", "me", "layouts"}


def _layouts(value: object) -> dict[str, Any]:
    """fanout.layouts: {member URL: layout or null}, each layout in the spec's shape."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_FANOUT:
        raise ValueError(f"fanout.layouts must map at most {MAX_FANOUT} member URLs to layouts")
    out = {}
    for url, layout in value.items():
        if not _is_agent_url(url):
            raise ValueError("fanout.layouts must be keyed by the members' http(s) URLs")
        if layout is not None:
            out[url.rstrip("/")] = _share(layout, None)[0]
    return out


#: an agent's URL as the spec gives it (docs/openapi.yaml): http(s), a host without brackets
#: (an IPv6 literal cannot name a fan-out member: urlsplit refuses most bracketed hosts)
#: (``\s`` as JSON Schema's ECMA regexes read it, which Python's does not: it adds \x1c-\x1f)
_ECMA_SPACE = "\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_AGENT_URL = re.compile(f"https?://[^/?#\\[\\]{_ECMA_SPACE}]+")


def _is_agent_url(url: str) -> bool:
    if len(url) > 512 or not _AGENT_URL.match(url):
        return False
    try:
        return bool(urlsplit(url).netloc)
    except ValueError:
        return False


#: the longest ``GET /v1/prefetch/{id}?wait=`` holds a request for the prefetch to end
WAIT_SECONDS = 30.0


async def get_prefetch(request: web.Request) -> web.Response:
    """The prefetch's record; ``?wait=<s>``: once it has ended, or after that long (a long
    poll: the scheduler learns of the end at once, with one request, not one per poll)."""
    record = request.app[PREFETCHER].jobs.get(request.match_info["id"])
    if record is None:
        raise web.HTTPNotFound(reason="no such prefetch")
    wait = query_seconds(request, "wait", WAIT_SECONDS)
    if wait and record.state not in FINAL:
        waiters, client = request.app[PREFETCH_WAITERS], request.remote or ""
        if not waiters.enter(client):
            return limits.too_many(f"{waiters.limit} waits in flight from {client} already")
        try:
            await _until_ended(record, request.app[STOPPING], wait)
        finally:
            waiters.leave(client)
    return web.json_response(record.to_dict())


async def _until_ended(record: PrefetchJob, stopping: asyncio.Event, seconds: float) -> None:
    """Until ``record`` ends, the agent stops (its shutdown waits for no poll), or
    ``seconds`` pass."""
    waits = [asyncio.ensure_future(e.wait()) for e in (record.ended, stopping)]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


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
