"""Which S3 failures are worth another try, and how long to wait before it: one policy
for every S3 request, async (S3Store) or blocking (S3RangeReader). botocore's and s3fs's
own retries are off, so this is the only layer (stacked, they multiplied)."""

from __future__ import annotations

import random
import re

import aiohttp
import botocore.exceptions
import urllib3.exceptions

ATTEMPTS = 6  # tries per request; at a 10% fault rate all six fail once in a million
BACKOFF_SECONDS = 0.1  # first retry waits up to this; doubles per retry, capped below
BACKOFF_CAP_SECONDS = 5.0
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestLimitExceeded",
    "InternalError",
    "ServiceUnavailable",
}
_TRANSIENT_TYPES = (
    botocore.exceptions.HTTPClientError,  # connection closed, read timeout, torn stream
    botocore.exceptions.ConnectionError,  # refused, connect timeout
    botocore.exceptions.IncompleteReadError,
    aiohttp.ClientError,  # payload errors while reading a body (async client)
    urllib3.exceptions.HTTPError,  # the same, blocking client (S3RangeReader)
    TimeoutError,
    ConnectionError,
)


class ShortBodyError(Exception):
    """A reply body shorter than the range it claims to hold (a torn or tampered read)."""


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return code if isinstance(code, str) else None
    return None


def is_transient(exc: BaseException) -> bool:
    """Worth another try: the server or the network failed, not the request."""
    if isinstance(exc, (ShortBodyError, *_TRANSIENT_TYPES)):
        return True
    status = http_status(exc)
    if status is None:
        return False
    return status >= 500 or status == 429 or _error_code(exc) in _TRANSIENT_CODES


def http_status(exc: BaseException) -> int | None:
    for cause in (exc, exc.__cause__, exc.__context__):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def backoff_seconds(tried: int) -> float:
    """The wait after the ``tried``-th failure: exponential, capped, jittered (retries of
    many requests that failed together do not arrive together)."""
    cap = min(BACKOFF_CAP_SECONDS, BACKOFF_SECONDS * 2 ** (tried - 1))
    return random.uniform(cap / 2, cap)


def range_length(content_range: str) -> int | None:
    """How many bytes a ``Content-Range: bytes a-b/n`` reply must hold, None if none given."""
    match = _CONTENT_RANGE.fullmatch(content_range)
    return int(match.group(2)) - int(match.group(1)) + 1 if match else None
