"""Scoped credentials (issue 30), on real agents on loopback: with ``peer_token_file`` the
peer token reads chunks (GET /v1/chunks/{id}) and gets 403 on every other route of
docs/openapi.yaml, every method; the main token keeps every route; no token or a wrong one
is a 401, as before. Both tokens are read again when their files change, never logged, and
agents present the peer token to their peers."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import yaml

from agent.daemon.config import ConfigError, load_config
from agent.rpc.auth import Refusals
from agent.rpc.client import FerryClient
from tests.conftest import prefetched, random_bytes, tree_bytes
from tests.harness import agent, push_series, save
from transfer.engine.catalog import Catalog
from transfer.store import open_store

SPEC = Path(__file__).resolve().parents[1] / "docs" / "openapi.yaml"
MAIN, PEER = "the-operators-token", "the-peers-token"
CHUNK_ROUTE = ("GET", "/v1/chunks/{id}")
_METHODS = ("get", "post", "put", "delete", "patch")


def spec_routes() -> list[tuple[str, str]]:
    doc = yaml.safe_load(SPEC.read_text())
    return [(m.upper(), path) for path, item in doc["paths"].items() for m in item if m in _METHODS]


def write_token(path: Path, token: str) -> None:
    """A token file, replaced in one rename (as a kubelet updates a mounted Secret)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(token + "\n")
    tmp.chmod(0o600)
    os.replace(tmp, path)


def tokens(root: Path, main: str = MAIN, peer: str | None = PEER) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    write_token(root / "token", main)
    env = {"FERRY_TOKEN_FILE": str(root / "token")}
    if peer is not None:
        write_token(root / "peer-token", peer)
        env["FERRY_PEER_TOKEN_FILE"] = str(root / "peer-token")
    return env


def one_step(root: Path, mib: int = 3, seed: int = 0) -> Path:
    shards = {f"__{i}_0.distcp": random_bytes(1 << 20, seed + i) for i in range(mib)}
    return save(root / "step_000020", shards)


async def a_chunk_id(store_url: str) -> str:
    store = open_store(store_url)
    try:
        (manifest,) = await Catalog(store).manifests("llm", 20)
    finally:
        await store.close()
    return next(c.id for f in manifest.files for c in f.chunks)


async def status(session: aiohttp.ClientSession, method: str, url: str, auth: str | None) -> int:
    headers = {"Authorization": auth} if auth is not None else {}
    body = b"{}" if method in ("POST", "PUT") else None
    if body is not None:
        headers["Content-Type"] = "application/json"
    async with session.request(method, url, headers=headers, data=body) as resp:
        await resp.read()
        return resp.status


@asynccontextmanager
async def holder(tmp_path: Path, store_url: str) -> AsyncIterator[tuple[str, str]]:
    """An agent holding step 20 of "llm" in its hot dir, with both token files; yields its
    URL and the id of a chunk it holds."""
    src = one_step(tmp_path / "hot-a" / "llm")
    await push_series(store_url, [src])
    env = tokens(tmp_path / "secrets-a")
    async with agent(tmp_path / "hot-a", [store_url], "a", extra_env=env) as url:
        yield url, await a_chunk_id(store_url)


#: served on the agent's local socket only (tests/test_pull_via_agent.py): 403 over TCP
LOCAL_ONLY = ("POST", "/v1/pull")


def test_the_peer_token_reads_chunks_and_nothing_else(local_url: str, tmp_path: Path) -> None:
    routes = spec_routes()
    assert CHUNK_ROUTE in routes and ("GET", "/healthz") in routes

    async def go() -> None:
        async with holder(tmp_path, local_url) as (url, cid), aiohttp.ClientSession() as s:

            def at(path: str) -> str:
                path = path.replace("{id}", cid) if path == CHUNK_ROUTE[1] else path
                return url + re.sub(r"\{[^}]+\}", "a" * 64, path)

            for method, path in routes:
                got = await status(s, method, at(path), f"Bearer {PEER}")
                allowed = (method, path) in (CHUNK_ROUTE, ("GET", "/healthz"))
                assert got == (200 if allowed else 403), (method, path, got)
                if path != "/healthz":
                    for wrong in (None, "Bearer nope", f"Bearer {PEER}x", f"Basic {PEER}"):
                        assert await status(s, method, at(path), wrong) == 401, (path, wrong)
                main = await status(s, method, at(path), f"Bearer {MAIN}")
                if (method, path) == LOCAL_ONLY:  # (its caller is who the kernel says it is)
                    assert main == 403, main
                    continue
                assert main not in (401, 403) and main < 500, (method, path, main)
            assert await status(s, "HEAD", at(CHUNK_ROUTE[1]), f"Bearer {PEER}") == 200
            # a path no route serves: 403 to the peer token too (it is good for chunks only)
            assert await status(s, "GET", url + "/v1/nothing", f"Bearer {PEER}") == 403
            assert await status(s, "GET", url + "/v1/nothing", f"Bearer {MAIN}") == 404
            assert await status(s, "GET", url + "/v1/nothing", None) == 401

    asyncio.run(go())


def test_the_spec_documents_403_where_the_peer_token_gets_it() -> None:
    doc = yaml.safe_load(SPEC.read_text())
    for method, path in spec_routes():
        responses = doc["paths"][path][method.lower()]["responses"]
        if (method, path) in (CHUNK_ROUTE, ("GET", "/healthz")):
            assert "403" not in responses, path
        else:
            assert "403" in responses, (method, path)
    forbidden = doc["components"]["responses"]["Forbidden"]["content"]["application/json"]
    error = doc["components"]["schemas"]["Error"]
    assert forbidden["schema"] == {"$ref": "#/components/schemas/Error"}
    assert error.get("additionalProperties") is False
    assert set(forbidden["example"]) == set(error["properties"])


def test_both_tokens_are_read_again_when_their_files_change_and_never_logged(
    local_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secrets = tmp_path / "secrets-a"

    async def go() -> None:
        async with holder(tmp_path, local_url) as (url, cid), aiohttp.ClientSession() as s:
            chunk, listing = f"{url}/v1/chunks/{cid}", f"{url}/v1/checkpoints"
            write_token(secrets / "token", "main-2")
            write_token(secrets / "peer-token", "peer-2")
            assert await status(s, "GET", listing, f"Bearer {MAIN}") == 401
            assert await status(s, "GET", listing, "Bearer main-2") == 200
            assert await status(s, "GET", chunk, f"Bearer {PEER}") == 401
            assert await status(s, "GET", chunk, "Bearer peer-2") == 200
            assert await status(s, "GET", listing, "Bearer peer-2") == 403
            # a rotation half done (the file emptied first): the token in force stays
            (secrets / "peer-token").write_text("")
            assert await status(s, "GET", chunk, "Bearer peer-2") == 200
            write_token(secrets / "peer-token", "peer-3")
            assert await status(s, "GET", chunk, "Bearer peer-3") == 200
            assert await status(s, "GET", chunk, "Bearer peer-2") == 401

    asyncio.run(go())
    assert "peer_token_file changed but cannot be used" in caplog.text
    for token in (MAIN, PEER, "main-2", "peer-2", "peer-3"):
        assert token not in caplog.text
    # the refused calls are in the log (they were not at all), one line a minute per client
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert refused == ["refused GET /v1/checkpoints from 127.0.0.1: 401, missing or wrong "
                       "bearer token"], refused  # fmt: skip


def test_refused_calls_are_logged_a_line_per_client_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client trying tokens: its first refusal is logged, the next ones counted in the
    line after the window, another client's logged at once."""
    now = [0.0]
    refusals = Refusals(window=60.0, clock=lambda: now[0])
    wrong = "missing or wrong bearer token"
    with caplog.at_level(logging.WARNING, logger="agent.rpc.auth"):
        for _ in range(3):
            refusals.refused("GET", "/v1/checkpoints", "10.0.0.1", 401, wrong)
            now[0] += 1.0
        refusals.refused("GET", "/v1/pins", "10.0.0.2", 403, "the peer token reads chunks only")
        now[0] += 60.0
        refusals.refused("POST", "/v1/prefetch", "10.0.0.1", 401, wrong)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused GET /v1/checkpoints from 10.0.0.1: 401, missing or wrong bearer token",
        "refused GET /v1/pins from 10.0.0.2: 403, the peer token reads chunks only",
        "refused POST /v1/prefetch from 10.0.0.1: 401, missing or wrong bearer token "
        "(2 more refused since the last line)",
    ]


def test_agents_present_the_peer_token_to_their_peers(local_url: str, tmp_path: Path) -> None:
    """B's main token is not A's: B's chunk requests get in with the peer token alone. C has
    no peer token, so it presents its main token, which A refuses: C's chunks come from the
    tier."""

    async def go() -> tuple[dict, dict]:  # type: ignore[type-arg]
        async with holder(tmp_path, local_url) as (url_a, _):
            env_b = tokens(tmp_path / "secrets-b", main="b-only")
            env_c = tokens(tmp_path / "secrets-c", main="c-only", peer=None)
            async with (
                agent(tmp_path / "b", [local_url], "b", (url_a,), env_b) as url_b,
                FerryClient(url_b, "b-only") as b,
            ):
                from_b = await prefetched(b)
            async with (
                agent(tmp_path / "c", [local_url], "c", (url_a,), env_c) as url_c,
                FerryClient(url_c, "c-only") as c,
            ):
                from_c = await prefetched(c)
            return from_b, from_c

    from_b, from_c = asyncio.run(go())
    src = tree_bytes(tmp_path / "hot-a" / "llm" / "step_000020")
    assert tree_bytes(Path(from_b["dest"])) == src == tree_bytes(Path(from_c["dest"]))
    assert from_b["bytes_by_source"][f"tier:{local_url}"] == 0
    assert from_b["bytes_by_source"]["peer"] > 0
    assert not from_c["bytes_by_source"].get("peer") and from_c["bytes_by_peer"] == {}


def test_a_peer_token_that_is_the_main_token_or_missing_is_refused(tmp_path: Path) -> None:
    base = {"FERRY_NODE": "x", "FERRY_HOT_DIR": str(tmp_path)}
    same = tokens(tmp_path / "same", main="one", peer="one")
    with pytest.raises(ConfigError, match="peer_token_file holds token_file's token"):
        load_config(None, {**base, **same})
    missing = {**tokens(tmp_path / "ok"), "FERRY_PEER_TOKEN_FILE": str(tmp_path / "nope")}
    with pytest.raises(ConfigError, match="cannot read peer_token_file"):
        load_config(None, {**base, **missing})
    empty = tokens(tmp_path / "empty", peer="")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(None, {**base, **empty})
