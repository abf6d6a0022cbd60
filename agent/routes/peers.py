"""Chunks from this node's hot data, for peer agents."""

from __future__ import annotations

import logging

from aiohttp import web

from agent.appkeys import CONFIG, HOT_INDEX, LANDING, METRICS
from agent.fanout import WAIT_SECONDS
from agent.peers import encode_for_peer
from agent.peerwire import ENCODING_HEADER
from transfer.format.chunkid import is_chunk_id

log = logging.getLogger(__name__)


async def get_chunk(request: web.Request) -> web.Response:
    """A chunk from this node's hot data or from a restore running here, for peer agents
    (hash-checked first): raw, or encoded against ``?base=<chunk id>`` when this node holds
    that chunk too. ``?wait=<s>``: if a restore here expects the chunk, hold the request up
    to that long for it to land (fan-out restore)."""
    cid = request.match_info["id"]
    base = request.query.get("base")
    if not is_chunk_id(cid) or (base is not None and not is_chunk_id(base)):
        raise ValueError("not a chunk id")
    enc = request.query.get("enc")  # a hint: an unknown name is ignored
    wait = float(request.query.get("wait", "0"))
    if not 0.0 <= wait <= WAIT_SECONDS:
        raise ValueError(f"wait must be within 0..{WAIT_SECONDS:g} seconds")
    level = request.app[CONFIG].transfer_options().zstd_level
    landing = request.app[LANDING]  # a restore running here (fan-out: agent/fanout.py)
    where = landing.where(cid) or await request.app[HOT_INDEX].locate(cid)
    if where is None and wait:
        where = await landing.wait(cid, wait)
    found = await encode_for_peer(request.app[HOT_INDEX], cid, base, level, enc, where)
    if found is None:
        raise web.HTTPNotFound(reason="this node does not hold that chunk")
    enc, payload = found
    request.app[METRICS].inc("ferry_bytes_total", len(payload), direction="out", source="peer")
    return web.Response(
        body=payload, content_type="application/octet-stream", headers={ENCODING_HEADER: enc}
    )


ROUTES = [
    web.get("/v1/chunks/{id}", get_chunk),
]
