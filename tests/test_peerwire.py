"""A peer's chunk replies received off the event loop (agent/peers/wire.py), from a real
aiohttp server on loopback: kept connections, refusals, oversized and cut replies."""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from agent.peers.wire import ENCODING_HEADER, PeerWire

BODY = bytes(range(256)) * 4096  # 1 MiB


async def _serving(
    check: Callable[[str, PeerWire, web.AppRunner], Awaitable[None]], keepalive: float = 75.0
) -> None:
    """Run ``check(url, wire, runner)`` against a chunk route that serves BODY for "ok",
    BODY for "big" (more than asked for), 404 for anything else, and cuts "cut" short."""
    seen: list[str] = []

    async def chunk(request: web.Request) -> web.StreamResponse:
        cid = request.match_info["id"]
        seen.append(request.headers.get("Authorization", ""))
        if cid in ("ok", "big"):
            return web.Response(body=BODY, headers={ENCODING_HEADER: "zstd"})
        if cid == "cut":
            resp = web.StreamResponse(headers={"Content-Length": str(len(BODY))})
            await resp.prepare(request)
            await resp.write(BODY[:1000])
            assert request.transport is not None
            request.transport.close()
            return resp
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/v1/chunks/{id}", chunk)
    runner = web.AppRunner(app, keepalive_timeout=keepalive)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    wire = PeerWire("secret")
    try:
        await check(f"http://{host}:{port}", wire, runner)
        assert seen and set(seen) == {"Bearer secret"}
    finally:
        wire.close()
        await runner.cleanup()


def test_replies_arrive_whole_over_one_kept_connection_per_thread() -> None:
    async def check(url: str, wire: PeerWire, runner: web.AppRunner) -> None:
        def five() -> list[tuple[str, bytes] | None]:
            out = []
            for cid in ("ok", "missing", "ok", "big", "ok"):
                got = wire.get_chunk(url, cid, {"base": "b"}, len(BODY) - (cid == "big"), 5.0)
                out.append(None if got is None else (got[0], bytes(got[1])))
            return out

        got = await asyncio.to_thread(five)
        assert got == [("zstd", BODY), None, ("zstd", BODY), None, ("zstd", BODY)]
        # a refusal keeps the connection; a reply over the limit is never buffered: its
        # connection is closed, and the last request opened the one left
        assert wire._conns.count() == 1

    asyncio.run(_serving(check))


def test_a_reply_cut_short_raises_and_the_next_request_connects_anew() -> None:
    async def check(url: str, wire: PeerWire, runner: web.AppRunner) -> None:
        def cut_then_ok() -> bytes:
            with pytest.raises((http.client.HTTPException, OSError)):
                wire.get_chunk(url, "cut", {}, len(BODY), 5.0)
            got = wire.get_chunk(url, "ok", {}, len(BODY), 5.0)
            assert got is not None
            return bytes(got[1])

        assert await asyncio.to_thread(cut_then_ok) == BODY

    asyncio.run(_serving(check))


def test_a_kept_connection_the_peer_closed_is_replaced_once() -> None:
    async def check(url: str, wire: PeerWire, runner: web.AppRunner) -> None:
        def ok() -> bytes:
            got = wire.get_chunk(url, "ok", {}, len(BODY), 5.0)
            assert got is not None
            return bytes(got[1])

        one = ThreadPoolExecutor(1)  # the same thread, so the same kept connection
        loop = asyncio.get_running_loop()
        try:
            assert await loop.run_in_executor(one, ok) == BODY
            kept = wire._conns._all[:]
            await asyncio.sleep(0.5)  # the peer's keep-alive timeout closes it meanwhile
            assert await loop.run_in_executor(one, ok) == BODY
            assert wire._conns.count() == 1 and wire._conns._all != kept  # replaced, not added to
        finally:
            one.shutdown()

    asyncio.run(_serving(check, keepalive=0.1))


def test_nobody_listening_is_an_oserror() -> None:
    wire = PeerWire("secret")
    with pytest.raises(OSError):
        wire.get_chunk("http://127.0.0.1:9", "ok", {}, 10, 1.0)
