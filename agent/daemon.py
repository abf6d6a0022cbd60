"""``ferry agent``: serve the RPC (and, through its cleanup context, the hot-dir watcher,
the push queue and prefetches) until SIGTERM/SIGINT, then drain in-flight work."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from aiohttp import web

from agent.config import AgentConfig, effective_config
from agent.logs import event
from agent.rpc import create_app
from transfer.errors import FerryError

log = logging.getLogger(__name__)


async def serve(config: AgentConfig, token: str, ready: asyncio.Event | None = None) -> None:
    host, port = config.listen_host, config.listen_port
    try:  # before anything starts or is created: a port in use is one line, not a traceback
        sock = socket.create_server((host, port))
    except OSError as exc:
        raise FerryError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    app = create_app(config, token)
    runner = web.AppRunner(app, handle_signals=False)
    try:
        await runner.setup()
        site = web.SockSite(runner, sock)
        await site.start()
    except BaseException:
        sock.close()
        await runner.cleanup()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for key, value, source in effective_config(config):
        event(log, "config", key=key, value=value, source=source)
    event(log, "listening", node=config.node, address=f"http://{host}:{port}")
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
