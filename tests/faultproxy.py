"""A fault-injecting HTTP proxy for S3 (aiohttp, loopback) that tests put in front of the
real test server.

It forwards every request unchanged (the Host header too, so SigV4 signatures still match)
and, on a seeded fraction of requests, injects one fault instead:

- ``500``: InternalError; ``503``: SlowDown (the server never sees the request)
- ``reset``: the connection is dropped before the request is forwarded
- ``lost_reply``: the request is forwarded (the server acted on it), then the connection is
  dropped, so the client never learns it succeeded
- ``stall``: nothing happens for ``stall_seconds``, then the connection is dropped
- ``truncate``: the response announces its full Content-Length but the connection closes
  half way through the body
- ``short``: a ranged GET's reply is cut in half and its Content-Length made to match (a
  misbehaving middlebox: only Content-Range still tells the truth)

``down()`` takes the store away (the port refuses connections and open connections are
dropped) until ``up()``. The proxy runs its own event loop in a daemon thread so that sync
tests, ``asyncio.run`` tests and agent subprocesses can all use it. Decisions come from one
``random.Random(seed)`` in request arrival order.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import yarl
from aiohttp import web

KINDS = ("500", "503", "reset", "lost_reply", "stall", "truncate", "short")
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "expect",
    "te",
    "upgrade",
    "proxy-connection",
    "proxy-authorization",
}
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}


@dataclass
class ProxyStats:
    requests: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    refused: int = 0  # requests dropped while the store was down
    bytes_up: int = 0  # request bodies received (what clients sent towards the store)
    bytes_down: int = 0  # reply bodies sent back
    by_method: Counter[str] = field(default_factory=Counter)
    by_area: Counter[str] = field(default_factory=Counter)  # "GET manifests" -> requests


class OnItsOwnLoop:
    """A loopback server's plumbing: a free port, an event loop on a thread of its own (the
    tests that use it are synchronous), and the aiohttp runner and client session it owns."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)


class FaultProxy(OnItsOwnLoop):
    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        kinds: tuple[str, ...] = KINDS,
        seed: int = 0,
        stall_seconds: float = 3.0,
    ) -> None:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")
        self.upstream = upstream.rstrip("/")
        self.rate = rate
        self.kinds = kinds
        self.stall_seconds = stall_seconds
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._only: str | None = None
        self._budget: int | None = None
        self._down = False
        self._lock = threading.Lock()
        super().__init__()
        self._site: web.TCPSite | None = None

    # -- control (from any thread) -------------------------------------------------------

    def start(self) -> str:
        self._thread.start()
        self._call(self._start())
        return self.url

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def down(self) -> None:
        """The store goes away: connections are refused, open ones dropped."""
        self._down = True
        self._call(self._close_site())

    def up(self) -> None:
        self._down = False
        self._call(self._open_site())

    def set_faults(
        self,
        rate: float,
        kinds: tuple[str, ...] | None = None,
        *,
        only: str | None = None,
        budget: int | None = None,
    ) -> None:
        """Fault ``rate`` of the requests with ``kinds``; ``only``: just the requests whose
        path contains it; ``budget``: at most that many faults, then none."""
        with self._lock:
            self.rate = rate
            if kinds is not None:
                self.kinds = kinds
            self._only, self._budget = only, budget

    # -- the server ------------------------------------------------------------------------

    async def _start(self) -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=120),
            connector=aiohttp.TCPConnector(limit=64),
        )
        await self._open_site()

    async def _open_site(self) -> None:
        if self._site is None and self._runner is not None:
            self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
            await self._site.start()

    async def _close_site(self) -> None:
        site, self._site = self._site, None
        if site is not None:
            await site.stop()

    async def _stop(self) -> None:
        await self._close_site()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _draw(self, path: str) -> str | None:
        with self._lock:
            if (self._only is not None and self._only not in path) or self._budget == 0:
                return None
            if self.rate and self._rng.random() < self.rate:
                if self._budget is not None:
                    self._budget -= 1
                return self._rng.choice(self.kinds)
            return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.stats.requests += 1
        self.stats.bytes_up += len(body)
        self.stats.by_method[request.method] += 1
        self.stats.by_area[_area(request)] += 1
        if self._down:
            self.stats.refused += 1
            return _drop(request)
        fault = self._draw(request.path)
        if fault is not None:
            self.stats.faults[fault] += 1
        if fault in _ERRORS:
            status, code, message = _ERRORS[fault]
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
            )
            return web.Response(status=status, text=xml, content_type="application/xml")
        if fault == "reset":
            return _drop(request)
        if fault == "stall":
            await asyncio.sleep(self.stall_seconds)
            return _drop(request)
        assert self._session is not None
        up = await forward(
            self._session, request.method, self.upstream + request.path_qs,
            end_to_end(request.headers), body,
        )  # fmt: skip
        payload, status, reply_headers = up.payload, up.status, up.headers
        if fault == "lost_reply":
            return _drop(request)
        self.stats.bytes_down += len(payload)
        if fault == "short" and status == 206 and len(payload) > 1:
            payload = payload[: len(payload) // 2]
        if fault == "truncate" and len(payload) > 1:
            reply = web.StreamResponse(status=status, headers=reply_headers)
            reply.content_length = len(payload)
            await reply.prepare(request)
            await reply.write(payload[: len(payload) // 2])
            return _drop(request, flush=True)
        return await relay(request, Upstream(status, reply_headers, payload, up.length))


@dataclass(frozen=True)
class Upstream:
    """What the server answered a forwarded request."""

    status: int
    headers: dict[str, str]  # end-to-end ones only
    payload: bytes
    length: int  # its Content-Length (a HEAD's object length)


def end_to_end(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` without the hop-by-hop ones (and Host, so a SigV4 signature still holds)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


async def forward(
    session: aiohttp.ClientSession,
    method: str,
    url: str | yarl.URL,
    headers: dict[str, str],
    body: bytes,
) -> Upstream:
    """Send a request on as the client made it (no header added, no redirect followed)."""
    async with session.request(
        method,
        url,
        headers=headers,
        data=body if body or method in ("PUT", "POST") else None,
        allow_redirects=False,
        skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent"),
    ) as upstream:
        payload = await upstream.read()
        length = int(upstream.headers.get("Content-Length", 0))
        return Upstream(upstream.status, end_to_end(upstream.headers), payload, length)


async def relay(request: web.Request, up: Upstream) -> web.StreamResponse:
    """The client's reply: the server's, a HEAD's length included."""
    if request.method == "HEAD":  # no body, but the object's length must get through
        reply = web.StreamResponse(status=up.status, headers=up.headers)
        reply.content_length = up.length
        await reply.prepare(request)
        return reply
    return web.Response(status=up.status, headers=up.headers, body=up.payload)


def _drop(request: web.Request, *, flush: bool = False) -> web.StreamResponse:
    """Close the client's connection with no (further) reply: a reset, as far as it knows."""
    transport = request.transport
    if transport is not None:
        if flush:
            transport.close()  # send what was written, then FIN mid-body
        else:
            transport.abort()
    raise asyncio.CancelledError  # nothing more to send; aiohttp drops the handler quietly


def _area(request: web.Request) -> str:
    """ "GET manifests", "GET packs", "LIST": a request by method and the store area of its
    key (the top folder under the store's prefix: manifests/, packs/, complete/, ...)."""
    if request.method == "GET" and ("list-type" in request.query or "uploads" in request.query):
        return "LIST"
    for area in ("manifests", "packs", "complete", "pins", "heads", "locks", "gc"):
        if f"/{area}/" in request.path:
            return f"{request.method} {area}"
    return f"{request.method} {request.path.rsplit('/', 1)[-1]}"
