"""The one S3 client of a store: a blocking botocore client with a connection pool sized to
the store's threads, every request retried by one RetryPolicy, errors mapped to the store's
error classes.

Why blocking botocore rather than s3fs/aiobotocore (the stack until 2026-11): a pull moves
its bytes on reader threads anyway (the GIL is released while a thread waits on its socket,
and each body goes from the socket straight into the caller's buffer), so an async client
only added a second client, a second pool and a second retry loop (start-up was the same
either way: ``python -m bench.startup --old DIR``).

Settings that matter (shared notes, checked against botocore >= 1.36): the pool is sized
(botocore's default is 10); automatic checksums and payload signing are off (they break or
slow MinIO and SeaweedFS; each PUT carries an explicit CRC32 or Content-MD5 instead);
botocore's retries are off (ours: transfer/store/retry.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from transfer.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    NotFoundError,
    RangeNotSatisfiableError,
    StoreError,
)
from transfer.store.retry import RetryPolicy, ShortBodyError, http_status, range_length

T = TypeVar("T")


def map_error(exc: BaseException, what: str, attempts: int = 1) -> StoreError:
    """A botocore/urllib3 failure as the store's error class, in one line."""
    status = http_status(exc)
    # botocore's own retries are off; its "(reached max retries: 0)" would only mislead
    text = " ".join(str(exc).replace(" (reached max retries: 0)", "").split())
    if status == 412:
        return AlreadyExistsError(f"{what}: already exists")
    if status == 416:
        return RangeNotSatisfiableError(f"{what}: range past the end of the object")
    if status == 404:
        return NotFoundError(f"{what}: {text}")
    if status in (401, 403):
        return AccessDeniedError(f"{what}: access denied ({text}); check the AWS credentials")
    detail = f"{type(exc).__name__}: {text}"
    if attempts > 1:
        return StoreError(f"{what}: failed {attempts} times, the store may be down ({detail})")
    return StoreError(f"{what}: {detail}")


class S3Client:
    """Thread-safe; the botocore client is made on first use (importing botocore and loading
    the S3 model cost ~0.4 s: a command that never touches S3 does not pay it)."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None,
        key: str | None,
        secret: str | None,
        pool_size: int,
        connect_timeout: float,
        read_timeout: float,
        retry: RetryPolicy,
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.retry = retry
        self._settings: dict[str, Any] = dict(
            endpoint_url=endpoint_url,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            pool_size=pool_size,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self._client: Any = None
        self._lock = threading.Lock()

    def _botocore(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = _make_client(**self._settings)
            return self._client

    def call(
        self, method: str, what: str, *, on_try: Callable[[], None] | None = None, **kwargs: Any
    ) -> Any:
        """One S3 API call on the bucket, retried when transient (``on_try`` is told of
        each try: a caller may need to know whether an earlier one may have landed)."""

        def once() -> Any:
            if on_try is not None:
                on_try()
            return getattr(self._botocore(), method)(Bucket=self.bucket, **kwargs)

        return self._retrying(what, once)

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        return self.retry.run(attempt, lambda exc, tries: map_error(exc, what, tries))

    def get(self, full_key: str, what: str, byte_range: str | None = None) -> bytes:
        """A whole (small) object or a range of it; the body is read inside the attempt, so a
        torn or short body is retried too."""
        extra = {"Range": byte_range} if byte_range else {}

        def once() -> bytes:
            resp = self._botocore().get_object(Bucket=self.bucket, Key=full_key, **extra)
            body: bytes = resp["Body"].read()
            expected = range_length(str(resp.get("ContentRange", "")))
            if expected is not None and len(body) != expected:
                raise ShortBodyError(f"got {len(body)} of the {expected} bytes of the range")
            return body

        return self._retrying(what, once)

    def read_into(self, full_key: str, start: int, buf: memoryview, what: str) -> int:
        """Bytes of the object from ``start`` into ``buf``; how many it had there."""
        if not len(buf):
            return 0
        return self._retrying(what, lambda: self._read_once(full_key, start, buf))

    def _read_once(self, full: str, start: int, buf: memoryview) -> int:
        end = start + len(buf) - 1
        resp = self._botocore().get_object(
            Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end}"
        )
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
                    raise ShortBodyError(f"get {full}: body ended after {got} of {length} bytes")
                got += n
            done = True
            return got
        finally:
            if done:
                raw.release_conn()  # the body was read to its end: keep the connection
            else:
                raw.close()  # unknown state mid-body: never reuse this connection

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _make_client(
    *, pool_size: int, connect_timeout: float, read_timeout: float, **creds: Any
) -> Any:
    import botocore.session
    from botocore.config import Config

    return botocore.session.get_session().create_client(
        "s3",
        config=Config(
            max_pool_connections=pool_size,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"payload_signing_enabled": False},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": 1},  # ours: transfer/store/retry.py
        ),
        **creds,
    )


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
