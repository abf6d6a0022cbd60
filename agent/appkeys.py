"""The typed keys of the agent's aiohttp application: what the routes share (the config,
the tiers, the prefetcher, the push queue...), set up by agent/rpc.py."""

from __future__ import annotations

from aiohttp import web

from agent.auth import Credentials
from agent.config import AgentConfig
from agent.estimate import BandwidthMeter
from agent.fanout import Landing
from agent.holds import StepHolds
from agent.limits import InFlight
from agent.metrics import Metrics
from agent.peers import HotIndex, PeerSource
from agent.pins import LocalPins
from agent.prefetch import Prefetcher
from agent.pushqueue import PushQueue
from agent.retention import RetentionRunner
from agent.standby import Standby
from agent.tls import AgentTls

CONFIG = web.AppKey("config", AgentConfig)

CREDENTIALS = web.AppKey("credentials", Credentials)

TLS = web.AppKey("tls", AgentTls)

#: chunk requests in flight, per client (agent/limits.py)
CHUNK_CLIENTS = web.AppKey("chunk_clients", InFlight)

TIERS = web.AppKey("tiers", list)

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
