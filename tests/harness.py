"""The shared harness of the agent tests: real agents on loopback ports (in this process, or
a port for one in another process), pushing a series to a store, and a peer that dies. It also
holds the helpers the test modules share: ``ferry agent`` processes and their RPC, the push
queue with its watcher on a hot dir, and a store that watches a push."""

from __future__ import annotations

import asyncio
import contextlib
import filecmp
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent.daemon.config import load_config
from agent.node.hotdir import HotDir
from agent.node.journal import Journal
from agent.node.pushqueue import PushQueue
from agent.node.watcher import watch_hot_dir
from agent.rpc.app import create_app
from agent.rpc.appkeys import TLS
from agent.rpc.client import FerryClient
from tests.conftest import write_file
from transfer.engine import TransferOptions, push
from transfer.engine.catalog import init_store
from transfer.errors import StoreError
from transfer.format.layout import MANIFESTS_PREFIX, PACKS_PREFIX
from transfer.store import open_store
from transfer.store.base import Store, Upload

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
    init_tiers: bool = True,
) -> AsyncIterator[str]:
    """A real agent app on a loopback port; yields its base URL. ``config_text``: a TOML
    config file (for what the environment cannot say, like retention tiers). The port is
    bound (port 0) before the config is read, as ``ferry agent`` binds before it starts.
    ``init_tiers``: first make each reachable tier a store (``init_reachable``)."""
    if init_tiers:
        await init_reachable(tiers)
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
        app = create_app(load_config(config_file, env), TOKEN)
        tls = app[TLS].server_context()  # FERRY_TLS_CERT_FILE and the rest: an https agent
        runner = web.AppRunner(app)
        try:
            await runner.setup()
            await web.SockSite(runner, sock, ssl_context=tls).start()
            yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        finally:
            await runner.cleanup()


def peer_agent(hot: Path, tiers: list[str], peers: list[str], node: str):  # type: ignore[no-untyped-def]
    """agent() with peers configured."""
    return agent(hot, tiers, node, tuple(peers))


async def init_reachable(tiers: list[str]) -> None:
    """What a deployment does once before its agents start: ``ferry init`` of each tier
    (the agent refuses a tier that is not a store and never makes one). A tier a test made
    unreachable on purpose (a directory that does not exist, a server that is down) is
    left as it is."""
    for url in tiers:
        store = open_store(url)
        try:
            await store.check()
        except StoreError:
            continue
        finally:
            await store.close()
        store = open_store(url)
        try:
            await init_store(store)
        finally:
            await store.close()


def init_reachable_sync(tiers: list[str]) -> None:
    """``init_reachable`` from synchronous code, also where an event loop is running (a
    test body that builds a queue): on a thread of its own, with a loop of its own."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, init_reachable(tiers)).result()


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


# ---------------------------------------------------------------------------------------------
# agent processes: ``ferry agent`` as real processes on loopback, their RPC, checkpoint trees

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Node:
    """One ``ferry agent`` process (restartable with the same env, hence the same state)."""

    name: str
    hot: Path
    port: int
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    _logs: list[Any] = field(default_factory=list)
    #: more of the command line (``["--config", path]``: what the environment cannot say)
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "https" if self.env.get("FERRY_TLS_CERT_FILE") else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def tls(self) -> ssl.SSLContext | None:
        """A context that verifies this agent (against its own tls_ca_file), if it serves
        TLS: enough for /healthz, never a client certificate."""
        if not self.env.get("FERRY_TLS_CERT_FILE"):
            return None
        return ssl.create_default_context(cafile=self.env.get("FERRY_TLS_CA_FILE"))

    def start(self, within: float = 30.0) -> None:
        fh = self.log.open("ab")
        self._logs.append(fh)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "agent", *self.args],
            env=self.env,
            cwd=REPO,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + within
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"agent {self.name} exited {self.proc.returncode}:\n{self.logs()}")
            try:
                doc = get_json(self.url + "/healthz", token=None, timeout=1.0, context=self.tls())
                assert doc["node"] == self.name, doc  # not some other process on the port
                return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"agent {self.name} not healthy in {within}s:\n{self.logs()}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        for fh in self._logs:
            fh.close()
        self._logs.clear()

    def logs(self, tail: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def dump(self) -> str:
        """What the agent is doing (SIGUSR1: every thread's and task's stack, agent/daemon/
        dump.py) and the log before it: the message of a test that found it stuck."""
        if self.proc is not None and self.proc.poll() is None:
            before = self.logs(tail=10**9).count("end of the asyncio tasks ---")
            self.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 10
            while self.logs(tail=10**9).count("end of the asyncio tasks ---") == before:
                if time.monotonic() > deadline:  # (a blocked loop: the threads' stacks)
                    break
                time.sleep(0.05)
            time.sleep(0.2)  # (the tasks' stacks are written in one piece; let them land)
        return self.logs(tail=60_000)

    def pushes(self) -> list[dict[str, Any]]:
        return list(get_json(self.url + "/v1/pushes")["pushes"])

    def wait_durable(self, job: str, step: int, within: float = 60.0) -> list[dict[str, Any]]:
        """Poll /v1/pushes until every tier's row of (job, step) is durable."""
        deadline = time.monotonic() + within
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            rows = [r for r in self.pushes() if (r["job"], r["step"]) == (job, step)]
            failed = [r for r in rows if r["state"] == "failed"]
            assert not failed, f"push failed: {failed}\n{self.logs()}"
            if rows and all(r["state"] == "durable" for r in rows):
                return rows
            time.sleep(0.1)
        pytest.fail(f"{job} step {step} not durable on {self.name}: {rows}\n{self.logs()}")


def get_json(
    url: str,
    token: str | None = TOKEN,
    timeout: float = 10.0,
    context: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout, context=context) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


def make_node(
    tmp_path: Path,
    name: str,
    tiers: list[str],
    *,
    port: int | None = None,
    init_tiers: bool = True,
    **extra: str,
) -> Node:
    """A ``ferry agent`` process's setup (started by ``Node.start``); ``init_tiers``: its
    reachable tiers are made stores first (``init_reachable``)."""
    if init_tiers:
        init_reachable_sync(tiers)
    token_file = tmp_path / "token"
    if not token_file.exists():
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
    port = port or reserve_port()
    hot = tmp_path / f"hot-{name}"
    hot.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        FERRY_NODE=name,
        FERRY_HOT_DIR=str(hot),
        FERRY_TIERS=",".join(tiers),
        FERRY_PEERS="",
        FERRY_LISTEN=f"127.0.0.1:{port}",
        FERRY_TOKEN_FILE=str(token_file),
        FERRY_TRANSFER_CHUNK_SIZE_MIB="1",
        FERRY_TRANSFER_PART_SIZE_MIB="5",
        FERRY_TRANSFER_PACK_SIZE_MIB="10",
    )
    if any(t.startswith("s3://") for t in tiers):
        env["FERRY_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    env.update(extra)
    return Node(name, hot, port, env, tmp_path / f"agent-{name}.log")


@contextlib.contextmanager
def running(*nodes: Node) -> Iterator[None]:
    """Start the agents; always kill every one of them on the way out."""
    try:
        for node in nodes:
            node.start()
        yield
    finally:
        for node in nodes:
            node.close()


def rpc(url: str, call: str, *args: Any, **kwargs: Any) -> Any:
    """One FerryClient call from synchronous test code."""

    async def go() -> Any:
        async with FerryClient(url, TOKEN) as client:
            if call == "prefetch_and_wait":
                pid = await client.prefetch(*args)
                return await client.wait_prefetch(pid, **kwargs)
            return await getattr(client, call)(*args, **kwargs)

    return asyncio.run(go())


def files_of(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def assert_same_tree(got: Path, want: Path) -> None:
    """Same file names, byte-identical contents (compared file by file, not in memory)."""
    assert got.is_dir(), f"{got} is missing"
    assert files_of(got) == files_of(want)
    for rel in files_of(want):
        assert filecmp.cmp(got / rel, want / rel, shallow=False), f"{rel} differs"


# ---------------------------------------------------------------------------------------------
# the push queue on local tiers: a DCP-like save, polling, a queue and the watcher feeding it
# (QUEUE_OPTS and queue_agent are imported as OPTS and agent by the push-queue tests)

QUEUE_OPTS = TransferOptions(
    chunk_size=64 << 10, part_size=256 << 10, pack_size=1 << 20, window=4, workers=2
)
POLL = 0.05
MARKER = ".metadata"


def save(ckpt: Path, shards: dict[str, bytes]) -> Path:
    """What a DCP save does: every shard first, then ``.metadata`` via temp + rename."""
    for name, data in shards.items():
        write_file(ckpt / name, data)
    tmp = ckpt / ".metadata.tmp"
    tmp.write_bytes(b"dcp-metadata")
    os.rename(tmp, ckpt / MARKER)
    return ckpt


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        assert loop.time() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(0.02)


def tier_states(queue: PushQueue, job: str, step: int) -> dict[str, dict[str, object]]:
    return {r["tier"]: r for r in queue.states() if (r["job"], r["step"]) == (job, step)}


def make_queue(
    tiers: list[str], state: Path, node: str = "n1", **kw: object
) -> tuple[PushQueue, list[Store]]:
    """A push queue on ``tiers`` (the reachable ones made stores first, as for an agent:
    its pushes never make one)."""
    init_reachable_sync(tiers)
    stores = [open_store(t) for t in tiers]
    queue = PushQueue(
        list(zip(tiers, stores, strict=True)),
        Journal(state / "journal.sqlite3", node),
        node=node,
        **{"options": QUEUE_OPTS, "retry_seconds": POLL, "quiet_seconds": 0.0, **kw},  # type: ignore[arg-type]
    )
    return queue, stores


@asynccontextmanager
async def queue_agent(queue: PushQueue, hot: Path) -> AsyncIterator[None]:
    """The queue plus a watcher feeding it, stopped and drained on exit."""
    stop = asyncio.Event()
    await queue.start()
    watcher = asyncio.create_task(
        watch_hot_dir(HotDir(hot, MARKER), queue.on_committed, poll_seconds=POLL, stop=stop)
    )
    try:
        yield
    finally:
        stop.set()
        await watcher
        await queue.drain(0)
        queue.close()


# ---------------------------------------------------------------------------------------------
# a store that watches a push


class WatchingStore(Store):
    """Wraps a real store; after each completed part or pack it records what a reader
    would see under manifests/ at that moment, then optionally dies."""

    def __init__(self, inner: Store, die_after_parts: int | None = None) -> None:
        self.inner, self.url, self.min_part_size = inner, inner.url, inner.min_part_size
        self.manifests_seen_during_data: list[list[str]] = []
        self.parts = 0
        self.die_after_parts = die_after_parts

    async def _observe(self) -> None:
        self.parts += 1
        seen = [o.key for o in await self.inner.list(MANIFESTS_PREFIX)]
        self.manifests_seen_during_data.append(seen)

    def _maybe_die(self) -> None:
        if self.die_after_parts is not None and self.parts >= self.die_after_parts:
            raise ConnectionError("simulated network failure in the middle of a push")

    async def check(self) -> None:
        await self.inner.check()

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return await self.inner.get(key, start, end)

    async def put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        if key.startswith(PACKS_PREFIX):
            self._maybe_die()
        await self.inner.put(key, data, create_only=create_only)
        if key.startswith(PACKS_PREFIX):
            await self._observe()

    async def head(self, key: str):  # type: ignore[no-untyped-def]
        return await self.inner.head(key)

    async def list(self, prefix: str):  # type: ignore[no-untyped-def]
        return await self.inner.list(prefix)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def list_uploads(self, prefix: str):  # type: ignore[no-untyped-def]
        return await self.inner.list_uploads(prefix)

    async def abort_upload(self, pending) -> None:  # type: ignore[no-untyped-def]
        await self.inner.abort_upload(pending)

    async def begin_upload(self, key: str) -> Upload:
        inner, watcher = await self.inner.begin_upload(key), self

        class Watched(Upload):
            def __init__(self) -> None:
                self.key = key

            async def write_part(
                self, number: int, offset: int, data: bytes, receipt: Any = None
            ) -> None:
                watcher._maybe_die()  # the part never reaches the store
                await inner.write_part(number, offset, data, receipt)
                await watcher._observe()

            async def complete(self, *, create_only: bool = False) -> None:
                await inner.complete(create_only=create_only)
                await watcher._observe()

            async def abort(self) -> None:
                await inner.abort()

        return Watched()

    async def close(self) -> None:
        await self.inner.close()
