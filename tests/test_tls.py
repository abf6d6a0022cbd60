"""TLS on the agent (issue 30): real agents on loopback with certificates made here by the
openssl CLI (tests/tlscerts.py: a CA, certificates it signs for 127.0.0.1 by IP SAN, and a
second CA whose certificates must be refused). The listener serves HTTPS only, verified
against the CA; with ``tls_client_auth`` a client needs a certificate of that CA; peers,
fan-out members and standby replication talk TLS to each other and move bytes exactly; a
rotated certificate is served without a restart."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import ssl
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.cli.run import main as ferry
from agent.daemon.config import ConfigError, load_config
from agent.rpc.app import create_app
from agent.rpc.client import FerryClient, RpcError
from agent.rpc.tls import TlsError
from tests.conftest import prefetched, random_bytes, tree_bytes
from tests.harness import TOKEN, agent, get_json, make_node, push_series, running, save
from tests.tlscerts import Authority, Leaf, authority


@dataclass(frozen=True)
class Pki:
    ca: Authority
    a: Leaf  # agent a's (serial 10), b's (11), a's next (12): all of the CA
    b: Leaf
    rotated: Leaf
    client: Leaf  # a scheduler's client certificate (20)
    foreign: Leaf  # a client certificate of another CA (30)
    impostor: Leaf  # a server certificate of another CA (31)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = authority(root / "ca", "ferry-ca"), authority(root / "other", "other-ca")
    return Pki(
        ca=ca,
        a=ca.leaf("agent-a", 10),
        b=ca.leaf("agent-b", 11),
        rotated=ca.leaf("agent-a-next", 12),
        client=ca.leaf("scheduler", 20),
        foreign=other.leaf("intruder", 30),
        impostor=other.leaf("impostor", 31),
    )


def tls_env(leaf: Leaf, ca: Authority, *, client_auth: bool = False) -> dict[str, str]:
    env = {
        "FERRY_TLS_CERT_FILE": str(leaf.cert),
        "FERRY_TLS_KEY_FILE": str(leaf.key),
        "FERRY_TLS_CA_FILE": str(ca.pem),
    }
    if client_auth:
        env["FERRY_TLS_CLIENT_AUTH"] = "true"
    return env


def context(ca: Authority, client: Leaf | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca.pem))
    if client is not None:
        ctx.load_cert_chain(client.cert, client.key)
    return ctx


async def call(
    url: str, ctx: ssl.SSLContext, token: str | None = TOKEN
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.get(url, ssl=ctx, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def served_serial(url: str, ca: Authority) -> int:
    """(Blocking.) The serial number of the certificate a new connection to ``url`` is
    served, verified against ``ca``."""
    port = int(url.rsplit(":", 1)[1])
    ctx = context(ca)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
        ctx.wrap_socket(sock, server_hostname="127.0.0.1") as tls,
    ):
        cert = tls.getpeercert()
    assert cert is not None
    return int(str(cert["serialNumber"]), 16)


def one_step(root: Path, mib: int = 3, seed: int = 0) -> Path:
    """``<root>/step_000020``: ``mib`` random 1 MiB shards (one chunk each) and .metadata."""
    shards = {f"__{i}_0.distcp": random_bytes(1 << 20, seed + i) for i in range(mib)}
    return save(root / "step_000020", shards)


def test_a_tls_agent_serves_https_only_verified_against_its_ca(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ferry agent`` itself (a process): HTTPS verified against the CA, no plain HTTP,
    refused by a client that trusts only the system store; ``ferry estimate --ca-file``."""
    store = tmp_path / "store"
    store.mkdir()
    asyncio.run(push_series(str(store), [one_step(tmp_path / "src")]))
    node = make_node(tmp_path, "tls", [str(store)], **tls_env(pki.a, pki.ca))
    assert node.url.startswith("https://")
    with running(node):
        ca = context(pki.ca)
        assert get_json(node.url + "/healthz", token=None, context=ca)["node"] == "tls"
        assert "jobs" in get_json(node.url + "/v1/checkpoints", context=ca)
        plain = node.url.replace("https://", "http://")
        with pytest.raises((OSError, http.client.HTTPException)):  # not served at all
            get_json(plain + "/healthz", token=None)
        with pytest.raises(urllib.error.URLError) as refused:
            get_json(node.url + "/healthz", token=None, context=ssl.create_default_context())
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)

        argv = ["estimate", node.url, "--token-file", str(tmp_path / "token"), "--job", "llm"]
        assert ferry([*argv, "--json", "--ca-file", str(pki.ca.pem)]) == 0
        assert json.loads(capsys.readouterr().out)["node"] == "tls"
        assert ferry(argv) == 1  # the system store does not know the CA
        assert "certificate verify failed" in capsys.readouterr().err
    assert f"listening on {node.url}" in node.logs()
    assert TOKEN not in node.logs()


def test_with_client_auth_a_client_needs_a_certificate_of_the_ca(
    pki: Pki, local_url: str, tmp_path: Path
) -> None:
    async def go() -> None:
        await push_series(local_url, [one_step(tmp_path / "src")])
        env = tls_env(pki.a, pki.ca, client_auth=True)
        async with agent(tmp_path / "hot", [local_url], "m", extra_env=env) as url:
            bare = context(pki.ca)
            assert (await call(url + "/healthz", bare, token=None))[0] == 200  # a probe
            status, doc = await call(url + "/v1/checkpoints", bare)
            assert (status, doc["error"]) == (401, "a client certificate is required")
            assert (await call(url + "/v1/checkpoints", context(pki.ca, pki.client)))[0] == 200
            assert (await call(url + "/v1/checkpoints", context(pki.ca, pki.a)))[0] == 200
            for path in ("/healthz", "/v1/checkpoints"):  # refused in the handshake
                with pytest.raises(aiohttp.ClientError):
                    await call(url + path, context(pki.ca, pki.foreign))

            tls = {"ca_file": pki.ca.pem, "cert_file": pki.client.cert, "key_file": pki.client.key}
            async with FerryClient(url, TOKEN, **tls) as client:  # a scheduler
                assert "jobs" in await client.checkpoints()
            async with FerryClient(url, TOKEN, ca_file=pki.ca.pem) as client:
                assert (await client.health())["ok"]
                with pytest.raises(RpcError) as no_cert:
                    await client.checkpoints()
                assert no_cert.value.status == 401

    asyncio.run(go())


def test_a_certificate_of_another_ca_is_refused_by_clients_and_peers(
    pki: Pki, local_url: str, tmp_path: Path
) -> None:
    """An agent serving a certificate another CA signed: the Python client refuses it, and
    so does an agent that has it as a peer (it then gets every chunk from the tier)."""
    src = one_step(tmp_path / "hot-a" / "llm")

    async def go() -> None:
        await push_series(local_url, [src])
        impostor = tls_env(pki.impostor, pki.ca)
        async with agent(tmp_path / "hot-a", [local_url], "a", extra_env=impostor) as url_a:
            async with FerryClient(url_a, TOKEN, ca_file=pki.ca.pem) as client:
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await client.health()
            async with (
                agent(tmp_path / "b", [local_url], "b", (url_a,), tls_env(pki.b, pki.ca)) as url_b,
                FerryClient(url_b, TOKEN, ca_file=pki.ca.pem) as b,
            ):
                done = await prefetched(b)
        assert tree_bytes(Path(done["dest"])) == tree_bytes(src)
        assert done["bytes_by_peer"] == {} and not done["bytes_by_source"].get("peer")
        assert done["bytes_by_source"][f"tier:{local_url}"] > 0

    asyncio.run(go())


def test_a_peer_fetch_between_two_mutual_tls_agents_is_byte_exact(
    pki: Pki, local_url: str, tmp_path: Path
) -> None:
    """B names its peer http://: it reaches it by https://, verified both ways."""
    src = one_step(tmp_path / "hot-a" / "llm", mib=4)

    async def go() -> None:
        await push_series(local_url, [src])
        env_a, env_b = (tls_env(leaf, pki.ca, client_auth=True) for leaf in (pki.a, pki.b))
        async with agent(tmp_path / "hot-a", [local_url], "a", extra_env=env_a) as url_a:
            named = (url_a.replace("https://", "http://"),)
            tls = {"ca_file": pki.ca.pem, "cert_file": pki.client.cert, "key_file": pki.client.key}
            async with (
                agent(tmp_path / "b", [local_url], "b", named, env_b) as url_b,
                FerryClient(url_b, TOKEN, **tls) as b,
            ):
                estimate = await b.estimate("llm")
                done = await prefetched(b)
        assert estimate["source"] == f"peer:{url_a}"  # probed over TLS too
        assert tree_bytes(Path(done["dest"])) == tree_bytes(src)
        assert done["bytes_by_source"][f"tier:{local_url}"] == 0
        assert done["bytes_by_peer"] == {url_a: done["bytes_by_source"]["peer"]} != {url_a: 0}

    asyncio.run(go())


def test_a_fan_out_between_two_tls_agents_reads_the_step_once_and_exactly(
    pki: Pki, local_url: str, tmp_path: Path
) -> None:
    """Members named http:// by the scheduler reach each other by https://, verified both
    ways; each chunk is read from the tier once, by its owner."""
    src = one_step(tmp_path / "src", mib=16)  # 16 chunks to split between the two

    async def go() -> list[dict[str, Any]]:
        await push_series(local_url, [src])
        env_a, env_b = (tls_env(leaf, pki.ca, client_auth=True) for leaf in (pki.a, pki.b))
        tls = {"ca_file": pki.ca.pem, "cert_file": pki.client.cert, "key_file": pki.client.key}
        async with (
            agent(tmp_path / "a", [local_url], "a", extra_env=env_a) as url_a,
            agent(tmp_path / "b", [local_url], "b", extra_env=env_b) as url_b,
            FerryClient(url_a, TOKEN, **tls) as a,
            FerryClient(url_b, TOKEN, **tls) as b,
        ):
            # as a scheduler may name them: http://, reached by https:// (agent/rpc/tls.py)
            members = [u.replace("https://", "http://") for u in (url_a, url_b)]
            ids = [await a.prefetch("llm", 20, fanout=(members, members[0]))]
            ids.append(await b.prefetch("llm", 20, fanout=(members, members[1])))
            return list(
                await asyncio.gather(a.wait_prefetch(ids[0], 60), b.wait_prefetch(ids[1], 60))
            )

    done = asyncio.run(go())
    one_copy = sum(len(v) for v in tree_bytes(src).values())
    from_tier = 0
    for status in done:
        assert status["state"] == "ready", status
        assert tree_bytes(Path(status["dest"])) == tree_bytes(src)
        from_tier += status["bytes_by_source"][f"tier:{local_url}"]
        assert sum(status["bytes_by_peer"].values()) == status["bytes_by_source"]["peer"] > 0
    assert from_tier <= 1.1 * one_copy  # each chunk read once, by its owner


def test_standby_replication_between_two_tls_agents_is_byte_exact(
    pki: Pki, local_url: str, tmp_path: Path
) -> None:
    src = one_step(tmp_path / "hot-a" / "llm")
    fast = {"FERRY_STANDBY_POLL_SECONDS": "0.1", "FERRY_STANDBY_MAX_RATE": "0"}

    async def go() -> dict[str, Any]:
        await push_series(local_url, [src])
        env_a = tls_env(pki.a, pki.ca, client_auth=True)
        env_b = {**tls_env(pki.b, pki.ca, client_auth=True), **fast}
        tls = {"ca_file": pki.ca.pem, "cert_file": pki.client.cert, "key_file": pki.client.key}
        async with (
            agent(tmp_path / "hot-a", [local_url], "a", extra_env=env_a) as url_a,
            agent(tmp_path / "b", [local_url], "b", (url_a,), env_b) as url_b,
            FerryClient(url_b, TOKEN, **tls) as b,
        ):
            await b.standby("llm")
            for _ in range(600):
                entry = (await b._call("GET", "/v1/standby"))["jobs"][0]
                if entry["replicated_step"] == 20:
                    return {**entry, "peer": url_a}
                await asyncio.sleep(0.05)
            raise AssertionError(f"never replicated: {entry}")

    entry = asyncio.run(go())
    last = entry["last_replication"]
    assert tree_bytes(Path(last["dest"])) == tree_bytes(src)
    assert last["bytes_by_source"][f"tier:{local_url}"] == 0
    assert last["bytes_by_peer"] == {entry["peer"]: last["bytes_by_source"]["peer"]}


def _replace(path: Path, source: Path) -> None:
    """Put ``source``'s bytes at ``path`` in one rename, as a kubelet updates a Secret."""
    tmp = path.with_name(path.name + ".new")
    shutil.copyfile(source, tmp)
    os.replace(tmp, path)


def test_a_rotated_certificate_is_served_without_a_restart(
    pki: Pki, local_url: str, tmp_path: Path
) -> None:
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    cert, key = tls_dir / "tls.crt", tls_dir / "tls.key"
    shutil.copyfile(pki.a.cert, cert)
    shutil.copyfile(pki.a.key, key)
    env = {
        "FERRY_TLS_CERT_FILE": str(cert),
        "FERRY_TLS_KEY_FILE": str(key),
        "FERRY_TLS_CA_FILE": str(pki.ca.pem),
    }

    async def go() -> None:
        await push_series(local_url, [one_step(tmp_path / "src")])
        async with (
            agent(tmp_path / "hot", [local_url], "r", extra_env=env) as url,
            FerryClient(url, TOKEN, ca_file=pki.ca.pem) as client,
        ):
            assert await asyncio.to_thread(served_serial, url, pki.ca) == 10
            assert (await client.health())["ok"]  # a kept connection, made before
            _replace(cert, pki.rotated.cert)
            _replace(key, pki.rotated.key)
            assert await asyncio.to_thread(served_serial, url, pki.ca) == 12  # the next one
            assert (await client.health())["ok"]
            # half a rotation (a new certificate, the key not yet): the last pair that loads
            # is served until the key follows
            _replace(cert, pki.b.cert)
            assert await asyncio.to_thread(served_serial, url, pki.ca) == 12
            _replace(key, pki.b.key)
            assert await asyncio.to_thread(served_serial, url, pki.ca) == 11

    asyncio.run(go())


def test_tls_settings_that_do_not_go_together_are_refused(pki: Pki, tmp_path: Path) -> None:
    base = {"FERRY_NODE": "x", "FERRY_HOT_DIR": str(tmp_path)}
    cert = {"FERRY_TLS_CERT_FILE": str(pki.a.cert)}
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file go together"):
        load_config(None, {**base, **cert})
    served = {**base, **cert, "FERRY_TLS_KEY_FILE": str(pki.a.key)}
    with pytest.raises(ConfigError, match="tls_client_auth = true needs"):
        load_config(None, {**served, "FERRY_TLS_CLIENT_AUTH": "true"})
    with pytest.raises(ConfigError, match="expected true or false"):
        load_config(None, {**served, "FERRY_TLS_CLIENT_AUTH": "yes"})
    peers = {"FERRY_PEERS": "http://10.0.0.2:7070,https://10.0.0.3:7070/"}
    assert load_config(None, {**served, **peers}).peers == (
        "https://10.0.0.2:7070",
        "https://10.0.0.3:7070",
    )
    assert load_config(None, {**base, **peers}).peers[0] == "http://10.0.0.2:7070"
    # files that are not a certificate and its key: the agent does not start
    bad = {**served, "FERRY_TLS_KEY_FILE": str(pki.b.key)}  # b's key, a's certificate
    with pytest.raises(TlsError, match="cannot load TLS files"):
        create_app(load_config(None, bad), TOKEN)
