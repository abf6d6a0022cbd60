"""The shared harness of the agent tests: real agents on loopback ports (in this process, or
a port for one in another process), pushing a series to a store, and a peer that dies."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from agent.client import FerryClient
from agent.config import load_config
from agent.rpc import create_app
from transfer.engine import TransferOptions, push
from transfer.store import open_store

TOKEN = "s3cret-token"
OPTS = TransferOptions(chunk_size=1 << 20, part_size=5 << 20, pack_size=10 << 20)

_HELD: list[socket.socket] = []  # reserve_port's sockets, open until the process exits


def reserve_port() -> int:
    """A loopback port for an agent in another process, which binds it itself, or for a
    member that never runs. It is bound here (port 0) with SO_REUSEADDR and held, never
    listening, until the test process exits: the kernel hands it to no one else and a
    connection to it is refused, while an agent's own bind (socket.create_server, which
    sets SO_REUSEADDR) still succeeds, as Linux lets such sockets share a port while the
    one already there does not listen. An agent in this process binds port 0 itself
    (``agent``), as does ``DyingProxy``."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return int(sock.getsockname()[1])


@asynccontextmanager
async def agent(
    hot: Path,
    tiers: list[str],
    node: str = "b",
    peers: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    config_text: str | None = None,
) -> AsyncIterator[str]:
    """A real agent app on a loopback port; yields its base URL. ``config_text``: a TOML
    config file (for what the environment cannot say, like retention tiers). The port is
    bound (port 0) before the config is read, as ``ferry agent`` binds before it starts."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    env = {
        "FERRY_NODE": node,
        "FERRY_HOT_DIR": str(hot),
        "FERRY_TIERS": ",".join(tiers),
        "FERRY_PEERS": ",".join(peers),
        "FERRY_LISTEN": f"127.0.0.1:{port}",
        "FERRY_TRANSFER_CHUNK_SIZE_MIB": "1",
        "FERRY_TRANSFER_PART_SIZE_MIB": "5",
        "FERRY_TRANSFER_PACK_SIZE_MIB": "10",
        "FERRY_QUIET_SECONDS": "0.2",
        **(extra_env or {}),
    }
    if "AWS_ENDPOINT_URL" in os.environ:
        env["FERRY_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    config_file = None
    if config_text is not None:
        config_file = hot.parent / f"ferry-{node}.toml"
        config_file.write_text(config_text)
    with sock:  # closed on the way out, however far start-up got
        runner = web.AppRunner(create_app(load_config(config_file, env), TOKEN))
        try:
            await runner.setup()
            await web.SockSite(runner, sock).start()
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


def peer_agent(hot: Path, tiers: list[str], peers: list[str], node: str):  # type: ignore[no-untyped-def]
    """agent() with peers configured."""
    return agent(hot, tiers, node, tuple(peers))


async def push_series(store_url: str, dirs: list[Path], node: str = "a") -> None:
    store = open_store(store_url)
    try:
        for d in dirs:
            step = int(d.name.split("_")[1])
            await push(store, d, job="llm", step=step, node=node, options=OPTS)
    finally:
        await store.close()


class DyingProxy:
    """A real HTTP proxy in front of a peer that forwards ``budget`` chunk requests and then
    goes away (its port closes), as a node that dies in the middle of a prefetch does."""

    def __init__(self, target: str, budget: int) -> None:
        self.target, self.budget, self.served = target, budget, 0
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        if self.served >= self.budget:
            asyncio.get_running_loop().call_soon(asyncio.ensure_future, self.stop())
            raise web.HTTPServiceUnavailable()
        self.served += 1
        async with (
            aiohttp.ClientSession() as s,
            s.get(
                self.target + request.path,
                headers={"Authorization": request.headers["Authorization"]},
            ) as r,
        ):
            return web.Response(status=r.status, body=await r.read())

    async def start(self) -> str:
        """Serve on a port the kernel picks; return its URL."""
        app = web.Application()
        app.router.add_get("/v1/chunks/{id}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()


async def prefetch_through(proxy: DyingProxy, hot: Path, tiers: list[str], node: str) -> dict:  # type: ignore[type-arg]
    """Prefetch the latest "llm" onto a new agent whose only peer is ``proxy``."""
    url_proxy = await proxy.start()
    try:
        async with (
            peer_agent(hot, tiers, [url_proxy], node) as url,
            FerryClient(url, TOKEN) as client,
        ):
            return await client.wait_prefetch(await client.prefetch("llm"), within_s=60)
    finally:
        await proxy.stop()
