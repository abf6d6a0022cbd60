"""The S3 client's error table: which failures of its transports (botocore for writes,
obstore and s3ranges for reads) are worth another try, and the StoreError each becomes.
The transports hand their failures here as types this table knows: botocore's own,
ReplyError for an HTTP error reply (obstore and s3ranges), ShortBodyError for a torn body,
ConnectionError or TimeoutError where no reply came."""

from __future__ import annotations

import re
import sys

from transfer.errors import (
    AccessDeniedError,
    AlreadyExistsError,
    NotFoundError,
    RangeNotSatisfiableError,
    StoreError,
)
from transfer.store.retry import ErrorTable, transient_os_error

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


class ShortBodyError(Exception):
    """A reply body shorter than announced or than the range it claims to hold (a torn or
    tampered read): transient."""


def _botocore_network_types() -> tuple[type[BaseException], ...]:
    """botocore's network failures, looked up only once it is loaded (an exception of its
    types implies it is): reads never import it (store/s3objects.py)."""
    if "botocore" not in sys.modules:
        return ()
    import botocore.exceptions
    import urllib3.exceptions

    return (
        botocore.exceptions.HTTPClientError,  # connection closed, read timeout, torn
        botocore.exceptions.ConnectionError,  # refused, connect timeout
        botocore.exceptions.IncompleteReadError,
        urllib3.exceptions.HTTPError,  # the same, raised while a body is read
    )


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


def _error_code(exc: BaseException) -> str | None:
    if isinstance(exc, ReplyError):
        return exc.code
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return code if isinstance(code, str) else None
    return None


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


def is_transient(exc: BaseException) -> bool:
    """Worth another try: the server or the network failed, not the request."""
    if isinstance(exc, (ShortBodyError, *_botocore_network_types())) or transient_os_error(exc):
        return True
    status = http_status(exc)
    if status is None:
        return False
    return status >= 500 or status == 429 or _error_code(exc) in _TRANSIENT_CODES


def map_error(
    exc: BaseException, what: str, attempts: int = 1, where: str | None = None
) -> StoreError:
    """A client's failure as the store's error class, in one line. ``where``: the bucket
    and key (or prefix) asked for, ``s3://bucket/key``, named when access is denied."""
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
        # the S3 error's Code and Message, not the client's text around the reply's XML
        code, message = s3_error(exc)
        reason = ": ".join(part for part in (code, message) if part) or f"HTTP {status}"
        target = f" to {where}" if where else ""
        return AccessDeniedError(
            f"{what}: access denied{target} ({reason}); check the AWS credentials"
        )
    detail = f"{type(exc).__name__}: {text}"
    if attempts > 1:
        return StoreError(f"{what}: failed {attempts} times, the store may be down ({detail})")
    return StoreError(f"{what}: {detail}")


S3_ERRORS = ErrorTable(transient=is_transient, mapped=map_error)
