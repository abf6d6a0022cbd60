"""The restore's S3 ranged reads (transfer/store/s3ranges.py): signed as botocore signs,
received into the caller's buffer, streamed piece by piece over one kept connection,
resumed where they stood after a torn body, and every error reply typed in one line."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path

import pytest

from tests.conftest import open_test_store, random_bytes
from tests.faultproxy import FaultProxy
from tests.s3server import S3Endpoint
from transfer.errors import AccessDeniedError, NotFoundError, RangeNotSatisfiableError
from transfer.store.retry import RetryPolicy
from transfer.store.s3client import S3Client, S3Settings
from transfer.store.s3ranges import HttpRanges, make_ranges
from transfer.store.sigv4 import Credentials, canonical_path, sign

pytestmark = pytest.mark.s3


def test_signature_is_the_one_botocore_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    import botocore.auth
    from botocore.awsrequest import AWSRequest
    from botocore.config import Config
    from botocore.credentials import Credentials as BotoCredentials

    when = datetime.datetime(2026, 12, 1, 21, 30, 5, tzinfo=datetime.UTC)
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: when)
    for token in (None, "session-token"):
        creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
        path = canonical_path("/bucket/job a/packs/0d/x~y_z.pack")
        headers = {"Range": "bytes=5-99"}
        ours = sign("GET", "127.0.0.1:9000", path, headers, creds, "eu-west-1", when)
        request = AWSRequest("GET", "http://127.0.0.1:9000" + path, headers=dict(headers))
        request.context["client_config"] = Config(s3={"payload_signing_enabled": False})
        boto = BotoCredentials(creds.access_key, creds.secret_key, token)
        botocore.auth.S3SigV4Auth(boto, "s3", "eu-west-1").add_auth(request)
        assert ours["authorization"] == request.headers["Authorization"]
        assert ours["x-amz-content-sha256"] == request.headers["X-Amz-Content-SHA256"]


def _client(endpoint: str, bucket: str, attempts: int = 6) -> S3Client:
    return S3Client(
        S3Settings(bucket, endpoint), RetryPolicy(attempts=attempts, first_backoff=0.01)
    )


def _put(s3_url: str, key: str, data: bytes) -> None:
    async def put() -> None:
        store = open_test_store(s3_url)
        try:
            await store.put(key, data)
        finally:
            await store.close()

    asyncio.run(put())


def _full_key(s3_url: str, key: str) -> str:
    return s3_url.split("/", 3)[3] + "/" + key


def _blob(s3_url: str, size: int, seed: int) -> tuple[bytes, str]:
    """Random bytes stored as packs/blob, and the object's full key."""
    data = random_bytes(size, seed=seed)
    _put(s3_url, "packs/blob", data)
    return data, _full_key(s3_url, "packs/blob")


def test_a_stream_reads_a_range_in_pieces_over_one_kept_connection(
    s3_env: S3Endpoint, s3_url: str
) -> None:
    data, key = _blob(s3_url, 5 << 20, seed=3)
    client = _client(s3_env.url, s3_env.bucket)
    try:
        assert client.streams()
        for lo, hi in ((0, len(data)), (12345, 3 << 20), (len(data) - 100, len(data) + 4096)):
            got = bytearray()
            buf = memoryview(bytearray(700_001))  # pieces that straddle the server's frames
            with client.stream(key, lo, hi, "get blob") as body:  # type: ignore[union-attr]
                while n := body.fill(buf):
                    got += buf[:n]
            assert bytes(got) == data[lo:hi]
        ranges = client._ranges
        assert isinstance(ranges, HttpRanges) and ranges._conns.count() == 1  # reused throughout
        buf = memoryview(bytearray(1000))
        assert client.read_into(key, 10, buf, "get blob") == 1000 and buf == data[10:1010]
    finally:
        client.close()


def test_a_read_beside_an_open_stream_takes_a_second_kept_connection(
    s3_env: S3Endpoint, s3_url: str, s3_proxy: FaultProxy
) -> None:
    # a cold restore reads a delta's base while the range of deltas is still streaming
    data, key = _blob(s3_url, 5 << 20, seed=5)
    client = _client(s3_proxy.url, s3_env.bucket)
    try:
        before = s3_proxy.stats.requests
        got, side = bytearray(), memoryview(bytearray(1000))
        buf = memoryview(bytearray(1 << 20))
        with client.stream(key, 0, len(data), "get blob") as body:  # type: ignore[union-attr]
            while n := body.fill(buf):
                got += buf[:n]
                if len(got) == 2 << 20:
                    assert client.read_into(key, 777, side, "get base") == 1000
        assert bytes(got) == data and side == data[777:1777]
        # one request each: the stream was not cut (and resumed) by the read beside it
        assert s3_proxy.stats.requests - before == 2
        for _ in range(3):  # both connections are kept for the thread's next requests
            assert client.read_into(key, 5, side, "get base") == 1000 and side == data[5:1005]
        ranges = client._ranges
        assert isinstance(ranges, HttpRanges) and ranges._conns.count() == 2
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["truncate", "short", "reset", "500", "503"])
def test_a_stream_torn_half_way_resumes_from_where_it_stood(
    s3_env: S3Endpoint, s3_url: str, s3_proxy: FaultProxy, kind: str
) -> None:
    data, key = _blob(s3_url, 6 << 20, seed=4)
    client = _client(s3_proxy.url, s3_env.bucket, attempts=20)
    s3_proxy.set_faults(1.0, (kind,), budget=2)  # the first two requests fail
    try:
        got = bytearray()
        buf = memoryview(bytearray(1 << 20))
        stream = client.stream(key, 0, len(data), "get blob")
        assert stream is not None
        with stream:
            while n := stream.fill(buf):
                got += buf[:n]
        assert bytes(got) == data
        assert s3_proxy.stats.faults[kind] == 2
        if kind == "truncate":  # cut in the body: a retry asks for the rest, not it all again
            assert s3_proxy.stats.bytes_down < 2 * len(data)
    finally:
        client.close()


def test_error_replies_are_typed_in_one_line(
    s3_env: S3Endpoint, s3_url: str, tmp_path: Path
) -> None:
    _put(s3_url, "packs/small", b"x" * 100)
    client = _client(s3_env.url, s3_env.bucket)
    buf = memoryview(bytearray(10))
    try:
        with pytest.raises(NotFoundError, match=r"get missing: NoSuchKey"):
            client.read_into(_full_key(s3_url, "packs/none"), 0, buf, "get missing")
        with pytest.raises(RangeNotSatisfiableError):
            client.read_into(_full_key(s3_url, "packs/small"), 500, buf, "get small")
    finally:
        client.close()
    bad = S3Client(
        S3Settings(s3_env.bucket, s3_env.url, key=s3_env.access_key, secret="wrong"),
        RetryPolicy(attempts=2, first_backoff=0.01),
    )
    try:
        with pytest.raises(AccessDeniedError) as denied:
            bad.read_into(_full_key(s3_url, "packs/small"), 0, buf, "get small")
        assert "\n" not in str(denied.value) and "check the AWS credentials" in str(denied.value)
    finally:
        bad.close()


def test_no_credentials_anywhere_is_access_denied_in_one_line(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without static credentials the reads go to obstore with botocore's chain, which
    finds nothing here: the server's 403, said plainly (it said "KeyError: 'expires_at'")."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    client = _client(s3_endpoint.url, s3_endpoint.bucket, attempts=1)
    try:
        assert not client.streams()  # obstore's reads, not ours
        with pytest.raises(AccessDeniedError) as denied:
            client.read_into("any/key", 0, memoryview(bytearray(4)), "get key")
        assert "KeyError" not in str(denied.value) and "\n" not in str(denied.value)
    finally:
        client.close()


def test_nothing_listens_is_a_connection_error_in_one_line() -> None:
    settings = S3Settings("b", "http://127.0.0.1:9", key="k", secret="s")  # discard: refused
    client = S3Client(settings, RetryPolicy(attempts=1))
    try:
        with pytest.raises(Exception, match=r"Could not connect to the endpoint URL") as exc:
            client.read_into("k", 0, memoryview(bytearray(4)), "get k")
        assert "\n" not in str(exc.value)
    finally:
        client.close()


def test_reads_stay_on_obstore_without_static_credentials_or_behind_a_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = ("http://127.0.0.1:1", "b")
    timeouts = ("us-east-1", 1.0, 1.0)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    assert make_ranges(*args, None, None, *timeouts) is None  # the AWS chain: obstore's
    assert make_ranges(*args, "k", "s", *timeouts) is not None
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "t")
    from_env = make_ranges(*args, None, None, *timeouts)
    assert from_env is not None and from_env._creds == Credentials("k", "s", "t")
    assert make_ranges(None, "b.with.dots", "k", "s", *timeouts) is None  # AWS, path-style
    assert make_ranges(None, "plain", "k", "s", *timeouts) is not None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # for https URLs only
    assert make_ranges(*args, "k", "s", *timeouts) is not None
    assert make_ranges("https://s3.internal", "b", "k", "s", *timeouts) is None
    assert make_ranges(None, "plain", "k", "s", *timeouts) is None  # AWS: https
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert make_ranges(*args, "k", "s", *timeouts) is None
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    assert make_ranges(*args, "k", "s", *timeouts) is not None
