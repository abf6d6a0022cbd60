"""The typed keys of the agent's aiohttp application: what the routes share (the config,
the tiers, the prefetcher, the push queue...), set up by agent/rpc/app.py."""

from __future__ import annotations

import asyncio

from aiohttp import web

from agent.daemon.config import AgentConfig
from agent.node.estimate import BandwidthMeter
from agent.node.prefetch import Prefetcher
from agent.node.protected import LocalPins, StepHolds
from agent.node.pushqueue import PushQueue
from agent.node.retention_loop import RetentionRunner
from agent.node.standby import Standby
from agent.peers.chunks import HotIndex, PeerSource
from agent.peers.fanout import Landing
from agent.rpc.auth import Credentials, Refusals
from agent.rpc.limits import DestLocks, InFlight
from agent.rpc.metrics import Metrics
from agent.rpc.tls import AgentTls

CONFIG = web.AppKey("config", AgentConfig)

CREDENTIALS = web.AppKey("credentials", Credentials)

#: calls refused for who made them, logged (agent/rpc/auth.py)
REFUSALS = web.AppKey("refusals", Refusals)

TLS = web.AppKey("tls", AgentTls)

#: chunk requests in flight, per client (agent/rpc/limits.py)
CHUNK_CLIENTS = web.AppKey("chunk_clients", InFlight)

#: long polls of prefetches in flight, per client (agent/rpc/limits.py)
PREFETCH_WAITERS = web.AppKey("prefetch_waiters", InFlight)

#: set when the agent begins to stop: what a held request gives up for
STOPPING = web.AppKey("stopping", asyncio.Event)

TIERS = web.AppKey("tiers", list)

#: the pulls asked over the local socket, by destination (routes/pull.py)
LOCAL_PULLS = web.AppKey("local_pulls", DestLocks)

PREFETCHER = web.AppKey("prefetcher", Prefetcher)

METER = web.AppKey("meter", BandwidthMeter)

METRICS = web.AppKey("metrics", Metrics)

PINS = web.AppKey("pins", LocalPins)

PART_SIZES = web.AppKey("part_sizes", dict)

PUSHQUEUE = web.AppKey("pushqueue", PushQueue)

HOLDS = web.AppKey("holds", StepHolds)

RETENTION = web.AppKey("retention", RetentionRunner)

HOT_INDEX = web.AppKey("hot_index", HotIndex)

PEERS = web.AppKey("peers", PeerSource)

LANDING = web.AppKey("landing", Landing)

STANDBY = web.AppKey("standby", Standby)
