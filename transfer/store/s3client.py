"""The one S3 client of a store: every request retried by one RetryPolicy, errors mapped to
the store's error classes, concurrency bounded by the store's threads (``pool_size``).

Three transports, each chosen by ``python -m bench.s3_clients`` (bench/README.md, "S3
transports"): a restore's ranged GETs over http.client (s3ranges.py: half the client CPU
per GB), where the credentials are static and no proxy is named for the endpoint, else
on obstore; the other reads (GET, HEAD, LIST) on obstore (s3objects.py: the fastest
start-up); writes (PUT, DELETE and the multipart protocol) through a blocking botocore
client, imported on the first write: a pull never loads it. None retries on its own: every
request goes through ``retry.run_retried`` with this client's error table (s3errors.py).
The transports import s3config.py and s3errors.py, never this module.

Why blocking rather than s3fs/aiobotocore (the stack until 2026-11): a pull moves its bytes
on reader threads anyway, so an async client only added a second pool and a second retry
loop.

botocore settings that matter (shared notes, checked against botocore >= 1.36): the pool is
sized (botocore's default is 10); automatic checksums and payload signing are off (they break
or slow MinIO and SeaweedFS; each PUT carries an explicit CRC32 or Content-MD5 instead).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from transfer.errors import AccessDeniedError
from transfer.store.base import RangeStream
from transfer.store.retry import RetryPolicy, run_retried
from transfer.store.s3config import S3Settings, region_of
from transfer.store.s3errors import S3_ERRORS

T = TypeVar("T")


_UNSET: Any = object()


class S3Client:
    """Thread-safe; each transport is made on first use (a command that never reads, or
    never writes, does not load that one)."""

    def __init__(self, settings: S3Settings, retry: RetryPolicy) -> None:
        self.settings = settings
        self.bucket = settings.bucket
        self.retry = retry
        self._writer: Any = None
        self._reader: Any = None
        self._ranges: Any = _UNSET
        self._lock = threading.Lock()

    def _botocore(self) -> Any:
        with self._lock:
            if self._writer is None:
                self._writer = _make_client(self.settings)
            return self._writer

    def _objects(self) -> Any:
        with self._lock:
            if self._reader is None:
                from transfer.store import s3objects

                self._reader = s3objects.make_store(self.settings)
            return self._reader

    def call(
        self, method: str, what: str, *, on_try: Callable[[], None] | None = None, **kwargs: Any
    ) -> Any:
        """One S3 API call on the bucket through botocore (the writes), retried when
        transient (``on_try`` is told of each try: a caller may need to know whether an
        earlier one may have landed)."""

        def once() -> Any:
            if on_try is not None:
                on_try()
            return getattr(self._botocore(), method)(Bucket=self.bucket, **kwargs)

        return self._retrying(what, once, kwargs.get("Key", kwargs.get("Prefix")))

    def _retrying(self, what: str, attempt: Callable[[], T], key: str | None = None) -> T:
        """``attempt`` under the retry policy; ``key``: the bucket key (or prefix) it asks
        for, named in an access-denied error."""
        where = f"s3://{self.bucket}/{key}" if key is not None else f"s3://{self.bucket}"
        try:
            return run_retried(self.retry, S3_ERRORS, what, attempt, where)
        except AccessDeniedError as exc:
            if not self._credentials_missing():
                raise
            raise AccessDeniedError(
                f"{what}: access denied to {where}: no AWS credentials found, so the request "
                "went unsigned (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile "
                "or role botocore finds)"
            ) from exc

    def _credentials_missing(self) -> bool:
        """Whether no credentials were found anywhere, asked after access was denied (the
        server's "InvalidAccessKeyId" would blame a key nobody gave): static ones (the
        settings, the environment) settle it at once; else botocore's chain is asked each
        time, outside the lock (it may wait on an instance's metadata), and a chain that
        fails says nothing (the server's own error stands)."""
        st = self.settings
        if (st.key and st.secret) or (
            os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
        ):
            return False
        import botocore.exceptions
        import botocore.session

        try:
            return botocore.session.get_session().get_credentials() is None
        except botocore.exceptions.BotoCoreError:
            return False

    def _ranged(self) -> Any:
        """The ranged-read transport (s3ranges.HttpRanges), or None: obstore's."""
        with self._lock:
            if self._ranges is _UNSET:
                from transfer.store.s3ranges import make_ranges

                st = self.settings
                self._ranges = make_ranges(
                    st.endpoint_url, st.bucket, st.key, st.secret, region_of(st.endpoint_url),
                    st.connect_timeout, st.read_timeout,
                )  # fmt: skip
            return self._ranges

    def get(
        self, full_key: str, what: str, start: int | None = None, end: int | None = None
    ) -> Any:
        """A whole (small) object, or its bytes ``start``..``end`` (end exclusive), as a
        buffer; the body is read inside the attempt, so a torn or short one is retried."""
        from transfer.store import s3objects

        return self._retrying(
            what, lambda: s3objects.get(self._objects(), full_key, start, end), full_key
        )

    def read_into(self, full_key: str, start: int, buf: memoryview, what: str) -> int:
        """Bytes of the object from ``start`` into ``buf``; how many it had there."""
        if not len(buf):
            return 0
        ranges = self._ranged()
        if ranges is not None:  # received straight into buf
            return self._retrying(
                what, lambda: int(ranges.read_into(full_key, start, buf)), full_key
            )
        body = self.get(full_key, what, start, start + len(buf))
        buf[: len(body)] = memoryview(body)
        return len(body)

    def streams(self) -> bool:
        """True when ranged reads stream (``stream`` answers)."""
        return self._ranged() is not None

    def stream(self, full_key: str, start: int, end: int, what: str) -> RangeStream | None:
        """Bytes ``start``..``end`` as one request read piece by piece (a RangeStream), or
        None where the reads stay on obstore (one request per read)."""
        ranges = self._ranged()
        if ranges is None:
            return None
        from transfer.store.s3ranges import ResumingStream

        return ResumingStream(
            ranges, full_key, start, end, lambda attempt: self._retrying(what, attempt, full_key)
        )

    def head(self, full_key: str, what: str) -> int:
        """The object's size."""
        from transfer.store import s3objects

        return self._retrying(what, lambda: s3objects.head(self._objects(), full_key), full_key)

    def list_dirs(self, full_prefix: str, what: str) -> list[str]:
        """The names one level below ``full_prefix`` (a delimiter listing)."""
        from transfer.store import s3objects

        return self._retrying(
            what, lambda: s3objects.list_dirs(self._objects(), full_prefix), full_prefix
        )

    def list(self, full_prefix: str, what: str) -> list[tuple[str, int]]:
        """(key, size) of every object whose key starts with ``full_prefix``."""
        from transfer.store import s3objects

        return self._retrying(
            what, lambda: s3objects.list_prefix(self._objects(), full_prefix), full_prefix
        )

    def holds_objects(self, full_prefix: str, what: str) -> bool:
        """Whether anything is stored under ``full_prefix`` (one request)."""
        from transfer.store import s3objects

        return self._retrying(what, lambda: s3objects.holds_objects(self._objects(), full_prefix))

    def check(self, full_prefix: str, what: str) -> None:
        """Raises unless the bucket can be listed (one request)."""
        from transfer.store import s3objects

        self._retrying(what, lambda: s3objects.reachable(self._objects(), full_prefix), full_prefix)

    def close(self) -> None:
        with self._lock:
            writer, self._writer, self._reader = self._writer, None, None
            ranges, self._ranges = self._ranges, _UNSET
        if writer is not None:
            writer.close()
        if ranges is not None and ranges is not _UNSET:
            ranges.close()


def _make_client(settings: S3Settings) -> Any:
    import botocore.session
    from botocore.config import Config

    return botocore.session.get_session().create_client(
        "s3",
        config=Config(
            max_pool_connections=settings.pool_size,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"payload_signing_enabled": False},
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            retries={"total_max_attempts": 1},  # ours: transfer/store/retry.py
        ),
        endpoint_url=settings.endpoint_url,
        aws_access_key_id=settings.key,
        aws_secret_access_key=settings.secret,
    )
