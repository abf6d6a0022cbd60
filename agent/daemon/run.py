"""``ferry agent``: serve the RPC (and, through its cleanup context, the hot-dir watcher,
the push queue and prefetches) until SIGTERM/SIGINT, then drain in-flight work."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from pathlib import Path

from aiohttp import web

from agent.daemon import dump, logs
from agent.daemon.config import (
    AgentConfig,
    ConfigError,
    effective_config,
    example_toml,
    load_config,
)
from agent.daemon.localsocket import LocalSocket
from agent.daemon.logs import event
from agent.rpc.app import create_app
from agent.rpc.appkeys import TLS
from transfer.errors import FerryError

log = logging.getLogger(__name__)


def run_agent(config_path: Path | None, *, print_example_config: bool = False) -> int:
    """``ferry agent``: load the config (``config_path`` and FERRY_* variables), then serve
    until a signal; the exit status, with any error as one line on stderr."""
    if print_example_config:
        print(example_toml(), end="")
        return 0
    logs.setup("text")
    try:
        config = load_config(config_path, create_token=True)
        logs.setup(config.log_format)
        token = config.read_token()
        if not token:
            raise ConfigError("set token_file (or FERRY_TOKEN_FILE): the RPC requires a token")
    except (FerryError, OSError) as exc:
        print(f"ferry agent: error: {exc}", file=sys.stderr)
        return 1
    try:
        asyncio.run(serve(config, token))
    except FerryError as exc:
        print(f"ferry agent: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # its state dir or hot dir unusable: one line, not a traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"ferry agent: error: cannot start: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    return 0


async def serve(config: AgentConfig, token: str, ready: asyncio.Event | None = None) -> None:
    host, port = config.listen_host, config.listen_port
    try:  # before anything starts or is created: a port in use is one line, not a traceback
        sock = socket.create_server((host, port))
    except OSError as exc:
        raise FerryError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if port == 0:  # the kernel chose: what the agent says it listens on is that port
        port = sock.getsockname()[1]
        config = dataclasses.replace(config, listen=f"{config.listen.rpartition(':')[0]}:{port}")
    local: LocalSocket | None = None
    app = create_app(config, token)
    runner = web.AppRunner(app, handle_signals=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # before it answers anything: a SIGUSR1 sent once /healthz answers never kills it (its
    # default action ends the process); SIGTERM and SIGINT keep theirs until it serves, so
    # a stop during a slow start (a tier's retries, a hung mount) ends it at once
    dump.install(loop)
    try:
        try:
            await runner.setup()
            site = web.SockSite(runner, sock, ssl_context=app[TLS].server_context())  # HTTPS only
            await site.start()
        except BaseException:
            sock.close()
            raise
        if config.local_socket:  # (once set up: a caller is answered, not held; plain HTTP:
            local = LocalSocket(config.local_socket)  # the kernel says who called; a failure
            await web.SockSite(runner, local.sock).start()  # is one line: the finally cleans)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        for key, value, source in effective_config(config):
            # (event leaves None out: an unset key would show no value at all)
            event(log, "config", key=key, value="(none)" if value is None else value, source=source)
        address = f"{'https' if config.tls_serving else 'http'}://{host}:{port}"
        event(log, "listening", node=config.node, address=address)
        print(f"ferry agent {config.node} listening on {address}", flush=True)
        if local is not None:
            event(log, "local_socket", node=config.node, path=str(local.path))
            print(f"ferry agent {config.node} serving its own user on {local.path} "
                  f"(`ferry pull` with FERRY_LOCAL_SOCKET={local.path} pulls through it)",
                  flush=True)  # fmt: skip
        if ready is not None:
            ready.set()
        await stop.wait()
        print(f"ferry agent {config.node}: draining (up to {config.drain_seconds}s)", flush=True)
    finally:
        await runner.cleanup()  # stops accepting, then the cleanup context drains prefetches
        if local is not None:
            local.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        dump.uninstall(loop)
    # (after the drain: an operator's `systemctl stop` ends on a line that says it ended)
    event(log, "stopped", node=config.node)
    print(f"ferry agent {config.node}: stopped", flush=True)
