"""``ferry agent``: serve the RPC (and, through its cleanup context, the hot-dir watcher,
the push queue and prefetches) until SIGTERM/SIGINT, then drain in-flight work."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from agent.config import AgentConfig
from agent.rpc import create_app

log = logging.getLogger(__name__)


async def serve(config: AgentConfig, token: str, ready: asyncio.Event | None = None) -> None:
    app = create_app(config, token)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    host, port = config.listen_host, config.listen_port
    site = web.TCPSite(runner, host, port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("ferry agent %s listening on %s:%s", config.node, host, port)
    print(f"ferry agent {config.node} listening on http://{host}:{port}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
        print(f"ferry agent {config.node}: draining (up to {config.drain_seconds}s)", flush=True)
    finally:
        await runner.cleanup()  # stops accepting, then the cleanup context drains prefetches
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
