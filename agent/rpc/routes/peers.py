"""Chunks from this node's hot data, for peer agents."""

from __future__ import annotations

import asyncio
import functools
import logging
import os

from aiohttp import web

from agent.peers.chunks import encode_for_peer
from agent.peers.fanout import WAIT_SECONDS
from agent.peers.wire import ENCODING_HEADER
from agent.rpc import limits
from agent.rpc.appkeys import CHUNK_CLIENTS, CONFIG, HOT_INDEX, LANDING, METRICS
from agent.rpc.middleware import query_seconds
from transfer.format.chunkid import is_chunk_id

log = logging.getLogger(__name__)


async def get_chunk(request: web.Request) -> web.StreamResponse:
    """A chunk from this node's hot data or from a restore running here, for peer agents
    (hash-checked first): raw, or encoded against ``?base=<chunk id>`` when this node holds
    that chunk too. ``?wait=<s>``: if a restore here expects the chunk, hold the request up
    to that long for it to land (fan-out restore)."""
    cid = request.match_info["id"]
    base = request.query.get("base")
    if not is_chunk_id(cid) or (base is not None and not is_chunk_id(base)):
        raise ValueError("not a chunk id")
    enc = request.query.get("enc")  # a hint: an unknown name is ignored
    wait = query_seconds(request, "wait", WAIT_SECONDS)
    clients, client = request.app[CHUNK_CLIENTS], request.remote or ""
    if not clients.enter(client):  # one client's requests in flight are bounded
        return limits.too_many(f"{clients.limit} chunk requests in flight from {client} already")
    try:
        return await _serve(request, cid, base, enc, wait)
    finally:
        clients.leave(client)


async def _serve(
    request: web.Request, cid: str, base: str | None, enc: str | None, wait: float
) -> web.StreamResponse:
    level = request.app[CONFIG].transfer_options().zstd_level
    landing = request.app[LANDING]  # a restore running here (fan-out: agent/peers/fanout.py)
    if request.method == "HEAD":  # (a fan-out's probe) whether its hot data holds it
        return await _holds(request, cid)
    where = landing.where(cid) or await request.app[HOT_INDEX].locate(cid)
    if where is None and wait:
        where = await landing.wait(cid, wait, functools.partial(request.app[HOT_INDEX].locate, cid))
    found = await encode_for_peer(request.app[HOT_INDEX], cid, base, level, enc, where)
    if found is None:
        raise web.HTTPNotFound(reason="this node does not hold that chunk")
    enc, payload = found
    request.app[METRICS].inc("ferry_bytes_total", len(payload), direction="out", source="peer")
    return await _send(request, payload, enc)


async def _holds(request: web.Request, cid: str) -> web.Response:
    """200 when a file of this node's hot data holds the chunk (nothing read), else 404.
    Not what a restore here has landed: the asker takes a 200 to mean the whole file it
    sampled is here, which a chunk fetched a moment ago does not say."""
    where = await request.app[HOT_INDEX].locate(cid)
    if where is None or not await asyncio.to_thread(os.path.isfile, where[0]):
        raise web.HTTPNotFound(reason="this node does not hold that chunk")
    return web.Response()


_PIECE = 1 << 20


async def _send(request: web.Request, payload: bytes | bytearray, enc: str) -> web.StreamResponse:
    """The reply, sent here (not after the handler) so that a client that stops reading is
    cut off after SEND_SECONDS, and its slot in CHUNK_CLIENTS is held no longer."""
    response = web.StreamResponse(headers={ENCODING_HEADER: enc})
    response.content_type = "application/octet-stream"
    response.content_length = len(payload)
    body = memoryview(payload)
    try:
        async with asyncio.timeout(limits.SEND_SECONDS):
            await response.prepare(request)
            # in pieces, each written once the client took the one before (aiohttp's
            # write of the whole reply would queue all of it in the transport and return)
            for at in range(0, len(body) if request.method != "HEAD" else 0, _PIECE):
                await response.write(body[at : at + _PIECE])
            await response.write_eof()
    except TimeoutError:
        log.warning("cut off %s: it took no chunk reply for %gs", request.remote,
                    limits.SEND_SECONDS)  # fmt: skip
        request.protocol.force_close()
    return response


ROUTES = [
    web.get("/v1/chunks/{id}", get_chunk),
]
