"""What the tiers and this node hold, this node's pushes, and what moving a checkpoint
here would cost: thin handlers over agent/node/listing.py and agent/node/estimate_sources.py."""

from __future__ import annotations

import math

from aiohttp import web

from agent.node.estimate_sources import PrefetchEstimator
from agent.node.listing import CheckpointListing
from agent.rpc.appkeys import CONFIG, METER, PART_SIZES, PINS, PREFETCHER, PUSHQUEUE, TIERS
from agent.rpc.middleware import parse_step_arg, required
from transfer.format.names import check_name


async def get_checkpoints(request: web.Request) -> web.Response:
    app = request.app
    listing = CheckpointListing(
        app[CONFIG], app[TIERS], app[PREFETCHER], app[PINS], app[PUSHQUEUE], app[PART_SIZES]
    )
    return web.json_response(await listing.document())


async def get_pushes(request: web.Request) -> web.Response:
    """Background pushes of this node's checkpoints: staged, durable per tier, or failed."""
    queue = request.app[PUSHQUEUE]
    return web.json_response({"node": request.app[CONFIG].node, "pushes": queue.states()})


async def get_estimate(request: web.Request) -> web.Response:
    query = request.query
    job = check_name("job", required(query, "job", "query parameter"))
    step = parse_step_arg(query.get("step", "latest"))
    try:  # ("invalid literal for int() with base 10: 'abc'" named neither parameter)
        gpus = int(query.get("gpus", "1"))
        price = float(query.get("gpu_hour_price", "0"))
        valid = 0 <= gpus <= 1_000_000 and math.isfinite(price) and 0 <= price <= 1e6
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(
            "gpus must be an integer in 0..1000000 and gpu_hour_price a price in 0..1e6"
        )
    layout = query.get("layout")  # "W:A,B": the share those ranks of W would read
    app = request.app
    estimator = PrefetchEstimator(app[CONFIG], app[TIERS], app[METER], app[PREFETCHER])
    doc = await estimator.estimate(job, step, gpus=gpus, gpu_hour_price=price, layout=layout)
    return web.json_response(doc)


ROUTES = [
    web.get("/v1/checkpoints", get_checkpoints),
    web.get("/v1/pushes", get_pushes),
    web.get("/v1/estimate", get_estimate),
]
