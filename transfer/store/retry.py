"""Which store failures are worth another try, and how long to wait before it: one policy
for every request of every backend (S3: control calls, ranged reads, part uploads; a local
or NFS directory: reads, lists, deletes, whole-object writes). botocore's and obstore's own
retries are off, so this is the only layer (stacked retry layers multiplied into a minute of
retries per request against a store that was down)."""

from __future__ import annotations

import errno
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from transfer.errors import StoreError
from transfer.options import StoreSettings

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
#: A file system's failures worth another try: what an NFS mount answers while its server
#: fails over or the network drops (soft mounts give EIO on a timeout). Retrying them on a
#: local disk costs a few seconds before the same error, so one rule serves both.
_TRANSIENT_ERRNOS = frozenset(
    {errno.ESTALE, errno.ETIMEDOUT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOLCK}
)
T = TypeVar("T")


def _transient_types() -> tuple[type[BaseException], ...]:
    """Network failures, by type. botocore's are looked up only once it is loaded (an
    exception of its types implies it is): reads never import it (store/s3objects.py)."""
    found: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)
    if "botocore" in sys.modules:
        import botocore.exceptions
        import urllib3.exceptions

        found += (
            botocore.exceptions.HTTPClientError,  # connection closed, read timeout, torn
            botocore.exceptions.ConnectionError,  # refused, connect timeout
            botocore.exceptions.IncompleteReadError,
            urllib3.exceptions.HTTPError,  # the same, raised while a body is read
        )
    return found


class ReplyError(Exception):
    """An HTTP error reply from a client that does not type it (obstore, s3ranges): its
    status, and the S3 error code and message when the reply named them."""

    def __init__(
        self, status: int, message: str, code: str | None = None, detail: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.detail = detail


def s3_error(exc: BaseException) -> tuple[str | None, str | None]:
    """The S3 error reply's ``Code`` and ``Message`` (either None where it had none)."""
    for cause in (exc, exc.__cause__, exc.__context__):
        if isinstance(cause, ReplyError):
            return cause.code, cause.detail
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            error = response.get("Error", {})
            code, message = error.get("Code"), error.get("Message")
            return (
                code if isinstance(code, str) and code else None,
                message if isinstance(message, str) and message else None,
            )
    return None, None


class ShortBodyError(Exception):
    """A reply body shorter than announced or than the range it claims to hold (a torn or
    tampered read): transient."""


def _error_code(exc: BaseException) -> str | None:
    if isinstance(exc, ReplyError):
        return exc.code
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return code if isinstance(code, str) else None
    return None


def is_transient(exc: BaseException) -> bool:
    """Worth another try: the server or the network failed, not the request."""
    if isinstance(exc, (ShortBodyError, *_transient_types())):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    status = http_status(exc)
    if status is None:
        return False
    return status >= 500 or status == 429 or _error_code(exc) in _TRANSIENT_CODES


def http_status(exc: BaseException) -> int | None:
    if isinstance(exc, ReplyError):
        return exc.status
    for cause in (exc, exc.__cause__, exc.__context__):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def range_length(content_range: str) -> int | None:
    """How many bytes a ``Content-Range: bytes a-b/n`` reply must hold, None if none given."""
    match = _CONTENT_RANGE.fullmatch(content_range)
    return int(match.group(2)) - int(match.group(1)) + 1 if match else None


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; after the n-th failure wait a jittered
    ``first_backoff * 2**(n-1)``, capped (retries of requests that failed together do not
    arrive together). Blocking: run it on the store's threads, never on an event loop."""

    attempts: int = StoreSettings.attempts
    first_backoff: float = 0.1
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")

    def backoff_seconds(self, tried: int) -> float:
        cap = min(self.max_backoff, self.first_backoff * 2 ** (tried - 1))
        return random.uniform(cap / 2, cap)

    def run(
        self,
        attempt: Callable[[], T],
        map_error: Callable[[BaseException, int], StoreError],
    ) -> T:
        """``attempt()`` until it succeeds, fails for good or the tries are used up; a
        failure comes out as ``map_error(exc, tries)`` (a StoreError passes through)."""
        for tried in range(1, self.attempts + 1):
            try:
                return attempt()
            except Exception as exc:
                if not is_transient(exc) or tried == self.attempts:
                    if isinstance(exc, StoreError):
                        raise
                    raise map_error(exc, tried) from exc
            time.sleep(self.backoff_seconds(tried))
        raise AssertionError("unreachable")
