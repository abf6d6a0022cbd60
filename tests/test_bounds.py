"""The agent bounded by design (issue 30, agent/rpc/limits.py), on real agents on loopback: past
a bound a client gets 429 with Retry-After at once; a body sent too slowly gets 408; a
client that stops reading a chunk reply is cut off; and the agent's own pushes go on
meanwhile. The bounds are patched small so each test takes a second or two."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest

from agent.rpc import app as rpc
from agent.rpc import limits
from tests.conftest import random_bytes
from tests.harness import TOKEN, agent, push_series, save
from transfer.engine import TransferOptions, push
from transfer.engine.catalog import Catalog
from transfer.store import open_store

AUTH = {"Authorization": f"Bearer {TOKEN}"}
NO_SUCH_CHUNK = "ab" * 32


def one_step(root: Path, step: int = 20, mib: int = 3) -> Path:
    shards = {f"__{i}_0.distcp": random_bytes(1 << 20, step + i) for i in range(mib)}
    return save(root / f"step_{step:06d}", shards)


def test_chunk_requests_past_a_clients_bound_get_429_with_retry_after(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rpc, "CHUNK_REQUESTS_PER_CLIENT", 2)

    async def go() -> None:
        await push_series(local_url, [one_step(tmp_path / "src")])
        async with agent(tmp_path / "hot", [local_url], "n") as url, aiohttp.ClientSession() as s:
            # each held 1 s (?wait: a chunk no restore here expects), three at once
            held = f"{url}/v1/chunks/{NO_SUCH_CHUNK}?wait=1"

            async def ask() -> tuple[int, str | None]:
                async with s.get(held, headers=AUTH) as r:
                    return r.status, r.headers.get("Retry-After")

            got = sorted(await asyncio.gather(ask(), ask(), ask()))
            assert got == [(404, None), (404, None), (429, "1")], got
            async with s.get(f"{url}/v1/chunks/{NO_SUCH_CHUNK}", headers=AUTH) as r:
                assert r.status == 404  # the slots were given back

    asyncio.run(go())


def test_prefetches_past_the_bound_get_429(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "MAX_PREFETCHES", 1)
    silent = socket.create_server(("127.0.0.1", 0))  # a fan-out member that never answers
    member = f"http://127.0.0.1:{silent.getsockname()[1]}"

    async def go() -> None:
        await push_series(local_url, [one_step(tmp_path / "src")])
        async with agent(tmp_path / "hot", [local_url], "n") as url, aiohttp.ClientSession() as s:
            body = {"job": "llm", "step": 20, "fanout": {"members": [url, member], "me": url}}
            async with s.post(f"{url}/v1/prefetch", json=body, headers=AUTH) as r:
                assert r.status == 202  # running: it probes the silent member for 2 s
            async with s.post(f"{url}/v1/prefetch", json={"job": "llm"}, headers=AUTH) as r:
                assert (r.status, r.headers["Retry-After"]) == (429, "1")
                assert (await r.json())["type"] == "TooManyRequests"

    with silent:
        asyncio.run(go())


def test_a_body_sent_too_slowly_gets_408(
    local_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "BODY_SECONDS", 0.3)

    async def go() -> bytes:
        await push_series(local_url, [one_step(tmp_path / "src")])
        async with agent(tmp_path / "hot", [local_url], "n") as url:
            port = int(url.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = (
                f"POST /v1/pins HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 40\r\n\r\n{"
            )
            writer.write(head.encode())  # and the rest of the body never comes
            await writer.drain()
            try:
                async with asyncio.timeout(10):
                    return await reader.readuntil(b"\r\n\r\n")
            finally:
                writer.close()
                await writer.wait_closed()

    assert asyncio.run(go()).startswith(b"HTTP/1.1 408")


def test_a_client_that_stops_reading_is_cut_off_and_pushes_go_on(
    local_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(limits, "SEND_SECONDS", 3.0)
    hot = tmp_path / "hot"
    big = save(hot / "llm" / "step_000010", {"__0_0.distcp": random_bytes(24 << 20, 1)})
    size = 24 << 20  # one chunk, more than the kernel's buffers on both sides hold

    async def go() -> tuple[int, bool, bool]:
        store = open_store(local_url)
        try:
            opts = TransferOptions(chunk_size=size, part_size=size, pack_size=size)
            await push(store, big, job="llm", step=10, node="n", options=opts)
            (manifest,) = await Catalog(store).manifests("llm", 10)
        finally:
            await store.close()
        cid = max((c for f in manifest.files for c in f.chunks), key=lambda c: c.size).id
        async with agent(hot, [local_url], "n") as url, aiohttp.ClientSession() as s:
            port = int(url.rsplit(":", 1)[1])
            stuck = socket.socket()
            stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stuck.connect(("127.0.0.1", port))
            stuck.sendall(
                f"GET /v1/chunks/{cid} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
            )  # and never reads
            # meanwhile training saves a new step here: the agent pushes it
            one_step(hot / "llm", step=20)
            pushed = False
            for _ in range(200):
                async with s.get(f"{url}/v1/pushes", headers=AUTH) as r:
                    rows = (await r.json())["pushes"]
                pushed = any(r["step"] == 20 and r["state"] == "durable" for r in rows)
                if pushed:
                    break
                await asyncio.sleep(0.02)
            still_held = "cut off" not in caplog.text  # the push did not wait for it
            await asyncio.sleep(limits.SEND_SECONDS + 0.5)  # past the bound: cut off
            received = await asyncio.to_thread(_drain, stuck)
            return received, pushed, still_held

    received, pushed, still_held = asyncio.run(go())
    assert pushed and still_held, "the agent's push stalled behind a stuck client"
    assert "cut off 127.0.0.1" in caplog.text
    assert 0 < received < size, received


def _drain(sock: socket.socket) -> int:
    """Every byte the server had sent before it cut the connection."""
    sock.settimeout(10)
    got = 0
    with sock:
        try:
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
    return got
