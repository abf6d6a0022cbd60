"""HTTP plumbing every route shares: auth (client certificates, bearer tokens and their
scopes), one mapping from error classes to status codes and one-line JSON errors, and the
validators of request input."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from aiohttp import web

from agent.daemon.localsocket import peer_uid
from agent.rpc import limits
from agent.rpc.appkeys import CONFIG, CREDENTIALS, REFUSALS
from agent.rpc.auth import PEER_ROUTES, Scope
from transfer.errors import (
    AccessDeniedError,
    CheckpointNotFoundError,
    DestinationError,
    FerryError,
    FormatError,
    StoreError,
)
from transfer.format.names import check_step

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: what the local socket serves (its callers have no token: nothing else of the API)
LOCAL_ROUTES = frozenset({("POST", "/v1/pull"), ("GET", "/healthz")})


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": message, "type": kind}, status=status)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route but /healthz: a client certificate when ``tls_client_auth`` (the TLS
    handshake verified any that was sent), then a bearer token; the peer token only for the
    routes peers call (agent/rpc/auth.py). Over the local socket the kernel's word on the
    caller stands in for all of it: the agent's own user may call ``LOCAL_ROUTES``, no
    other user anything (agent/daemon/localsocket.py)."""
    uid = local_caller(request)
    if uid is not None:
        if uid != os.geteuid():
            why = f"the local socket serves the agent's own user (uid {os.geteuid()}), not {uid}"
            return _refused(request, 403, why, "Forbidden")
        if _route(request) not in LOCAL_ROUTES:
            why = "the local socket serves POST /v1/pull only (the rest: over TCP, with the token)"
            return _refused(request, 403, why, "Forbidden")
    elif request.path != "/healthz":
        if request.app[CONFIG].tls_client_auth and not _client_certificate(request):
            return _refused(request, 401, "a client certificate is required", "Unauthorized")
        scope = request.app[CREDENTIALS].scope(request.headers.get("Authorization", ""))
        if scope is None:
            return _refused(request, 401, "missing or wrong bearer token", "Unauthorized")
        if scope is Scope.PEER and _route(request) not in PEER_ROUTES:
            why = "the peer token reads chunks only (GET /v1/chunks/{id})"
            return _refused(request, 403, why, "Forbidden")
    return await handler(request)


def local_caller(request: web.Request) -> int | None:
    """The user id of a caller over the agent's local socket; None over TCP."""
    transport = request.transport
    return peer_uid(transport.get_extra_info("socket") if transport is not None else None)


def _refused(request: web.Request, status: int, why: str, kind: str) -> web.Response:
    """The refusal's answer, and its line in the log (auth.Refusals: a few per client)."""
    refusals = request.app[REFUSALS]  # (the path as sent, percent-encoded: no line breaks)
    refusals.refused(request.method, request.rel_url.raw_path, request.remote or "?", status, why)
    return error_response(status, why, kind)


def _client_certificate(request: web.Request) -> bool:
    """Whether the connection's client presented a certificate (verified in the handshake
    against tls_ca_file: one that did not verify ended the connection there)."""
    transport = request.transport
    return transport is not None and bool(transport.get_extra_info("peercert"))


def _route(request: web.Request) -> tuple[str, str | None]:
    resource = request.match_info.route.resource  # None: no route matched (404, 405)
    return request.method, resource.canonical if resource is not None else None


_STATUS = [
    (CheckpointNotFoundError, 404),
    (DestinationError, 409),
    (FormatError, 400),
    (AccessDeniedError, 502),
    (StoreError, 502),
    (FerryError, 400),
]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.content_type == "application/json":
            raise
        response = error_response(exc.status, exc.reason, type(exc).__name__)
        if "Allow" in exc.headers:  # 405 must say what is allowed
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (FerryError, ValueError) as exc:
        status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 400)
        return error_response(status, " ".join(str(exc).split()), type(exc).__name__)


async def json_body(request: web.Request, fields: Collection[str]) -> dict[str, Any]:
    """The request's JSON object body, whose keys must be among ``fields`` (a typo'd key
    is a 400 naming it, not a default taken silently: ``stpe`` prefetched the latest
    step); a body that does not arrive within BODY_SECONDS (a client sending it slowly,
    or not at all) is a 408 and the connection is closed."""
    try:
        async with asyncio.timeout(limits.BODY_SECONDS):
            body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("request body is not JSON") from None
    except TimeoutError:
        request.protocol.close()  # the connection ends after the 408 (the rest is unread)
        raise web.HTTPRequestTimeout(reason="the request body did not arrive in time") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    if unknown := sorted(set(body) - set(fields)):
        raise ValueError(
            f"unknown body field {unknown[0]!r}; the fields are {', '.join(sorted(fields))}"
        )
    return body


def required(values: Mapping[str, Any], name: str, where: str) -> Any:
    """``values[name]``, or a 400 naming what is missing (``where``: "query parameter",
    "body field"), not the validator's "invalid job name None"."""
    value = values.get(name)
    if value is None or value == "":
        raise ValueError(f"missing {where} {name!r}")
    return value


def finite_number(value: object, low: float, high: float) -> bool:
    """A real JSON number (not a bool, NaN or infinity) in (low, high]."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low < value <= high
    )


def query_seconds(request: web.Request, name: str, most: float) -> float:
    """The query parameter ``name`` as seconds within 0..``most`` (absent: 0); anything
    else, NaN and infinity too, is a bad request."""
    try:
        seconds = float(request.query.get(name, "0"))
    except ValueError:
        seconds = math.nan
    if not 0.0 <= seconds <= most:
        raise ValueError(f"{name} must be a number of seconds within 0..{most:g}")
    return seconds


def parse_step(value: object) -> int:
    """A step number; 120.0 is one too (JSON Schema's integers include integral floats)."""
    if isinstance(value, float) and value.is_integer() and 0 <= value < 1e18:
        value = int(value)
    return check_step(value)


def parse_step_arg(value: object) -> int | None:
    """A step number, or None for 'latest'."""
    if value in (None, "latest"):
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return parse_step(value)


#: ranks one node hosts (far above any node's GPUs), and the largest world
MAX_LAYOUT_RANKS = 4096
MAX_WORLD = 1 << 20


def parse_layout(value: object) -> dict[str, Any] | None:
    """A request's ``layout``, ``{"world_size": W, "ranks": [ranks this node runs]}``, in
    the spec's shape (else a 400), or None. A rank outside the world is a share that cannot
    exist: a 404 (the spec's shape cannot say it, so no 400), as in ``GET /v1/estimate``;
    it was accepted, 202, and the prefetch failed when it ran."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"world_size", "ranks"}:
        raise ValueError('layout must be {"world_size": W, "ranks": [ranks this node runs]}')
    world, ranks = _whole(value["world_size"]), value["ranks"]
    if world is None or not 1 <= world <= MAX_WORLD:
        raise ValueError(f"layout.world_size must be a whole number in 1..{MAX_WORLD}")
    if not isinstance(ranks, list) or not 1 <= len(ranks) <= MAX_LAYOUT_RANKS:
        raise ValueError(f"layout.ranks must be a list of 1..{MAX_LAYOUT_RANKS} ranks")
    wholes = [_whole(r) for r in ranks]
    if not all(r is not None and 0 <= r < MAX_WORLD for r in wholes) or len(set(wholes)) != len(
        wholes
    ):
        raise ValueError(f"layout.ranks must be distinct whole numbers in 0..{MAX_WORLD - 1}")
    outside = [r for r in wholes if r is not None and r >= world]
    if outside:  # (the shape is right, the share cannot exist: a 404, as the estimate's)
        raise CheckpointNotFoundError(
            f"no such share: layout.ranks: {outside[0]} is not a rank of a world of {world} "
            f"(0..{world - 1})"
        )
    return {"world_size": world, "ranks": wholes}


def _whole(value: object) -> int | None:
    """A JSON integer (``3`` or ``3.0``, as JSON Schema counts them), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value)
