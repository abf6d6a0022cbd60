"""Blocking ranged GETs into a caller's buffer: the bulk read path of S3Store (RangeReader);
the same client also sends multipart parts from threads (``call``).

A plain (synchronous) botocore client, with the same endpoint, credentials, timeouts and
checksum settings as the store's async client. It is thread-safe and its urllib3 pool keeps
one connection per concurrent thread. Each body goes from the socket into the caller's
buffer with ``readinto``: no per-read ``bytes`` objects, no join, and the GIL is released
while the thread waits on the socket. Measured here (1 GB of 8 MiB ranges from SeaweedFS on
loopback, 2 cores): 0.84 s and 0.64 CPU s on 4 threads, against 1.25 s and 1.0 CPU s for the
same GETs through aiobotocore on one event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transfer.errors import StoreError
from transfer.store.base import RangeReader
from transfer.store.retry import (
    ATTEMPTS,
    ShortBodyError,
    backoff_seconds,
    is_transient,
    range_length,
)

MapError = Callable[[BaseException, str, int], StoreError]


class TornBodyError(StoreError):
    """The connection ended before the body did (retried)."""


class S3RangeReader(RangeReader):
    def __init__(
        self,
        bucket: str,
        full_key: Callable[[str], str],
        map_error: MapError,
        *,
        endpoint_url: str | None,
        key: str | None,
        secret: str | None,
        pool_size: int,
        connect_timeout: float,
        read_timeout: float,
        loader: Any = None,
    ) -> None:
        # imported here: only pulls need it, and it costs ~0.1 s of start-up
        import botocore.session
        from botocore.config import Config

        self._bucket = bucket
        self._full_key = full_key
        self._map_error = map_error
        session = botocore.session.get_session()
        if loader is not None:  # botocore's Loader, already holding the parsed models
            session.register_component("data_loader", loader)
        self._client: Any = session.create_client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            config=Config(
                max_pool_connections=pool_size,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                s3={"payload_signing_enabled": False},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"total_max_attempts": 1},  # ours: transfer/store/retry.py
            ),
        )

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        if not len(buf):
            return 0
        full = self._full_key(key)
        for tried in range(1, ATTEMPTS + 1):
            try:
                return self._read_once(full, start, buf)
            except Exception as exc:
                retry = isinstance(exc, TornBodyError) or is_transient(exc)
                if not retry or tried == ATTEMPTS:
                    if isinstance(exc, StoreError) and not retry:
                        raise
                    raise self._map_error(exc, f"get {key}", tried) from exc
            time.sleep(backoff_seconds(tried))
        raise AssertionError("unreachable")

    def _read_once(self, full: str, start: int, buf: memoryview) -> int:
        end = start + len(buf) - 1
        resp = self._client.get_object(Bucket=self._bucket, Key=full, Range=f"bytes={start}-{end}")
        raw = resp["Body"]._raw_stream  # the urllib3 response: it has readinto
        done = False
        try:
            length = int(resp["ContentLength"])
            content_range = str(resp.get("ContentRange", ""))
            ranged = content_range.startswith(f"bytes {start}-")
            if length > len(buf) or not (ranged or (start == 0 and not content_range)):
                # a server that ignored the Range header: these are not the bytes asked for
                got_range = content_range or "the whole object"
                raise StoreError(f"get {full}: asked for bytes {start}-{end}, got {got_range}")
            expected = range_length(content_range)
            if expected is not None and length != min(expected, len(buf)):
                # shorter than the range it claims to hold: a tampered or torn reply
                raise ShortBodyError(f"get {full}: {length} bytes for {content_range}")
            got = 0
            receive = _receiver(raw)
            while got < length:
                n = receive(buf[got:length])
                if not n:
                    raise TornBodyError(f"get {full}: body ended after {got} of {length} bytes")
                got += n
            done = True
            return got
        finally:
            if done:
                raw.release_conn()  # the body was read to its end: keep the connection
            else:
                raw.close()  # unknown state mid-body: never reuse this connection

    def call(self, method: str, **kwargs: Any) -> Any:
        """Any other blocking request on the bucket (S3Upload sends its parts this way)."""
        return getattr(self._client, method)(Bucket=self._bucket, **kwargs)

    def close(self) -> None:
        self._client.close()


def _receiver(raw: Any) -> Callable[[memoryview], int]:
    """``readinto`` straight from the socket when the body is plain bytes: urllib3's own
    ``readinto`` reads into a new ``bytes`` and copies it (two copies of every byte, and a
    fresh 8 MiB allocation per range: a third of a pull's receive time here). http.client's
    response under it fills the caller's buffer from the socket and ends the response when
    its length is read, so the connection is reused as usual."""
    fp = getattr(raw, "_fp", None)
    encoded = raw.headers.get("content-encoding") not in (None, "", "identity")
    if fp is None or encoded or not hasattr(fp, "readinto"):
        return raw.readinto  # type: ignore[no-any-return]
    return fp.readinto  # type: ignore[no-any-return]
