"""Every credential source and proxy setting of the AWS chain works on every S3 read
path: the restore's ranged reads (s3ranges over http.client, or obstore where it falls
back), whole-object reads, HEAD and LIST (obstore), and the writes (botocore).

A session token must be sent and signed on each request (SeaweedFS does not check it, so
a forwarding proxy in front of it records what each request carried); with HTTP_PROXY /
HTTPS_PROXY set, every request goes through that proxy (a real one, on loopback:
tests/httpproxy.py), and NO_PROXY exempts the endpoint again."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import random_bytes
from tests.httpproxy import ForwardingProxy, Seen
from tests.s3server import S3Endpoint
from transfer.store import StoreOptions, open_store
from transfer.store.s3 import S3Store
from transfer.store.s3config import proxy_for

pytestmark = pytest.mark.s3

TOKEN = "FwoGZXIvYXdzEXAMPLE-session-token//+="
DATA = random_bytes(3 << 20, seed=31)
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture(autouse=True)
def _no_ambient_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)


@pytest.fixture
def front(s3_env: S3Endpoint) -> Iterator[ForwardingProxy]:
    """A forwarding proxy, usable as the endpoint (in front of the test server) or as the
    HTTP proxy the environment names."""
    with ForwardingProxy(s3_env.url, resign=(s3_env.access_key, s3_env.secret_key)) as proxy:
        yield proxy


def _reads(url: str, endpoint: str) -> tuple[S3Store, dict[str, object]]:
    """Every read path of a store on ``url``: a put (botocore), a whole get, a ranged get,
    head and list (obstore), a ranged read and a streamed range (the restore's readers)."""

    async def go() -> tuple[S3Store, dict[str, object]]:
        store = open_store(url, StoreOptions(endpoint_url=endpoint))
        assert isinstance(store, S3Store)
        try:
            await store.put("packs/blob", DATA)
            got: dict[str, object] = {
                "whole": await store.get("packs/blob") == DATA,
                "range": await store.get("packs/blob", 100, 5000) == DATA[100:5000],
                "head": (await store.head("packs/blob")).size == len(DATA),
                "list": [o.key for o in await store.list("packs/")] == ["packs/blob"],
            }
            reader = store.range_reader()

            def ranged() -> tuple[bool, bool | None]:
                buf = memoryview(bytearray(1 << 20))
                read = reader.read_into("packs/blob", 777, buf) == len(buf)
                ok = read and buf == DATA[777 : 777 + len(buf)]
                stream = reader.stream("packs/blob", 10, len(DATA))
                if stream is None:  # obstore's reads: one request per read
                    return ok, None
                out = bytearray()
                with stream:
                    while n := stream.fill(buf):
                        out += buf[:n]
                return ok, bytes(out) == DATA[10:]

            got["read_into"], got["stream"] = await store.on_thread(ranged)
            got["streams"] = reader.streams()
            return store, got
        finally:
            await store.close()

    return asyncio.run(go())


def _signed_with_token(seen: Seen) -> bool:
    """The request carried the token, and its signature (checked by the proxy) covers it."""
    return seen.headers.get("x-amz-security-token") == TOKEN and seen.signature_ok is True


def _all_true(got: dict[str, object], streams: bool) -> None:
    assert got.pop("streams") is streams
    if not streams:
        assert got.pop("stream") is None
    assert all(v is True for v in got.values()), got


def test_a_session_token_in_the_environment_signs_the_ranged_reads_too(
    s3_url: str, front: ForwardingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Static credentials with a token (what `aws sts assume-role` exports): the ranged
    reads stay on http.client, and carry the token like every other request."""
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    _, got = _reads(s3_url, front.url)  # the proxy as the endpoint: it sees every request
    _all_true(got, streams=True)
    gets = front.requests("GET")
    assert {"PUT", "GET", "HEAD"} <= {s.method for s in front.requests()}
    assert any("range" in s.headers for s in gets)
    assert all(_signed_with_token(s) for s in front.requests()), front.requests()


def _credential_sources(tmp: Path, key: str, secret: str) -> dict[str, dict[str, str]]:
    """The environment of each non-static credential source (the AWS chain's profiles):
    a shared credentials file with a token, and a credential_process printing one."""
    creds = tmp / "credentials"
    creds.write_text(
        f"[ferry]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n"
        f"aws_session_token = {TOKEN}\n"
    )
    helper = tmp / "creds.py"
    reply = {"Version": 1, "AccessKeyId": key, "SecretAccessKey": secret, "SessionToken": TOKEN}
    helper.write_text(f"print({json.dumps(json.dumps(reply))})\n")
    config = tmp / "config"
    config.write_text(f"[profile ferry]\ncredential_process = {sys.executable} {helper}\n")
    return {
        "shared credentials file": {"AWS_SHARED_CREDENTIALS_FILE": str(creds)},
        "credential_process": {"AWS_CONFIG_FILE": str(config)},
    }


@pytest.mark.parametrize("source", ["shared credentials file", "credential_process"])
def test_credentials_from_a_profile_read_on_every_path_with_their_token(
    s3_url: str,
    s3_env: S3Endpoint,
    front: ForwardingProxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    source: str,
) -> None:
    """No credentials in the environment: botocore's chain finds them (a profile); the
    ranged reads fall back to obstore, which asks the same chain, token included."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _credential_sources(tmp_path, s3_env.access_key, s3_env.secret_key)[
        source
    ].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_PROFILE", "ferry")
    _, got = _reads(s3_url, front.url)
    _all_true(got, streams=False)
    assert any("range" in s.headers for s in front.requests("GET"))
    assert all(_signed_with_token(s) for s in front.requests()), front.requests()


def test_every_read_goes_through_the_proxy_the_environment_names(
    s3_url: str, s3_env: S3Endpoint, front: ForwardingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY (the endpoint is http) and HTTPS_PROXY set: the ranged reads leave
    http.client for obstore, which, like botocore, goes through the proxy, the session
    token on each request."""
    monkeypatch.setenv("HTTP_PROXY", front.url)
    monkeypatch.setenv("HTTPS_PROXY", front.url)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    assert proxy_for(s3_env.url) == front.url
    _, got = _reads(s3_url, s3_env.url)
    _all_true(got, streams=False)
    seen = front.requests()
    # spoken to as a proxy: each request names the server's URL in full
    assert seen and all(s.url.startswith(s3_env.url + "/") for s in seen), seen
    assert {"PUT", "GET", "HEAD"} <= {s.method for s in seen}
    assert any("range" in s.headers for s in front.requests("GET"))
    assert all(_signed_with_token(s) for s in seen)


def test_no_proxy_exempts_the_endpoint_and_the_ranged_reads_stream_again(
    s3_url: str, s3_env: S3Endpoint, front: ForwardingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", front.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    assert proxy_for(s3_env.url) is None
    _, got = _reads(s3_url, s3_env.url)
    _all_true(got, streams=True)
    assert front.requests() == []


def test_proxy_for_follows_the_environment_as_botocore_and_obstore_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert proxy_for("http://s3.example:9000") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://tls-proxy:3128")
    assert proxy_for("http://s3.example:9000") is None  # an https proxy, for https URLs
    assert proxy_for("https://b.s3.eu-west-1.amazonaws.com") == "http://tls-proxy:3128"
    monkeypatch.setenv("http_proxy", "http://plain-proxy:3128")
    assert proxy_for("http://s3.example:9000") == "http://plain-proxy:3128"
    monkeypatch.setenv("NO_PROXY", ".example")
    assert proxy_for("http://s3.example:9000") is None
    assert proxy_for("https://b.s3.eu-west-1.amazonaws.com") == "http://tls-proxy:3128"
