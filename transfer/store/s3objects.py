"""The S3 client's reads (GET, ranged GET, HEAD, LIST), on obstore.

Why obstore for reads (``python -m bench.s3_clients``, 2026-12-03, SeaweedFS on loopback):
a fresh process gets its first list answer in 0.16-0.19 s against botocore's 0.83-1.04 s
(cold page cache: botocore imports ~100 modules and parses its S3 model). A restore's
ranged GETs are http.client's (s3ranges.py: half the client CPU per GB) unless the
credentials come from botocore's chain or a proxy is set: then they are obstore's too, as
fast as botocore's at the same CPU per GB in 8 MiB ranges. Why writes stay on botocore:
obstore has no part-level multipart API, and our resumable uploads need ListParts and
per-part receipts.

Everything here is blocking and is called from the store's threads through the client's one
RetryPolicy: obstore's own retries are off. Its failures leave this module as the types the
policy knows (``_typed_errors``): obstore types the common cases (not found, denied) and
reports the rest as a GenericError whose text carries the HTTP status (-> ReplyError), or
none for a network failure (-> ConnectionError, transient, in one line).
"""

from __future__ import annotations

import datetime
import functools
import html
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    GenericError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import S3Store

from transfer.errors import StoreError
from transfer.store.s3config import region_of
from transfer.store.s3errors import ReplyError, ShortBodyError

if TYPE_CHECKING:
    from obstore.store import S3Config  # only in obstore's stubs

    from transfer.store.s3config import S3Settings

_STATUS = re.compile(r"status code: (\d{3})")
_HTTP_KIND = re.compile(r"HttpError\s*\{\s*kind:\s*(\w+)")
_OS_MESSAGE = re.compile(r'message: "([^"]+)"')
_URL = re.compile(r"Error performing \w+ (\w+://[^/?\s]+)")
_XML_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]{1,500})</Message>")
_NETWORK = {
    "Connect": "Could not connect to the endpoint",
    "Timeout": "no reply within the read timeout from",
    "Request": "the connection closed before a reply from",
    "Interrupted": "the connection closed in the middle of a reply from",
}


def make_store(settings: S3Settings) -> S3Store:
    endpoint_url = settings.endpoint_url
    config: S3Config = {"region": region_of(endpoint_url)}
    if endpoint_url:
        config["endpoint"] = endpoint_url  # path-style, as botocore does for a custom endpoint
    else:
        config["virtual_hosted_style_request"] = True  # AWS itself
    provider = None
    static = _static_credentials(settings.key, settings.secret)
    if static is not None:
        config.update(static)
    else:
        provider = _BotocoreCredentials()  # profiles, SSO, IMDS...: the whole AWS chain
    return S3Store(
        settings.bucket,
        config=config,
        client_options={
            "allow_http": True,  # the endpoint's scheme decides
            "pool_max_idle_per_host": str(settings.pool_size),
            "connect_timeout": datetime.timedelta(seconds=settings.connect_timeout),
            "read_timeout": datetime.timedelta(seconds=settings.read_timeout),
        },
        retry_config={  # ours: transfer/store/retry.py
            "max_retries": 0,
            "backoff": {},
            "retry_timeout": datetime.timedelta(seconds=settings.read_timeout),
        },
        credential_provider=provider,  # type: ignore[arg-type]
    )


def _static_credentials(key: str | None, secret: str | None) -> S3Config | None:
    if key and secret:
        return {"access_key_id": key, "secret_access_key": secret}
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not (key and secret):
        return None
    found: S3Config = {"access_key_id": key, "secret_access_key": secret}
    if os.environ.get("AWS_SESSION_TOKEN"):
        found["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    return found


class _BotocoreCredentials:
    """Credentials from botocore's chain, for a node without them in its environment;
    botocore caches and refreshes them, obstore asks again every few minutes."""

    def __init__(self) -> None:
        import botocore.session

        self._session = botocore.session.get_session()

    def __call__(self) -> dict[str, Any]:
        found = self._session.get_credentials()
        # obstore needs an expiry even on empty credentials (without one it fails with
        # "KeyError: 'expires_at'" where the server would have said 403)
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5)
        if found is None:
            return {"access_key_id": "", "secret_access_key": "", "expires_at": expires}
        frozen = found.get_frozen_credentials()
        creds: dict[str, Any] = {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "expires_at": expires,
        }
        if frozen.token:
            creds["token"] = frozen.token
        return creds


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status an obstore failure reports (None: none, e.g. the network failed)."""
    if isinstance(exc, FileNotFoundError):
        return 404
    if isinstance(exc, PermissionDeniedError):
        return 403
    if isinstance(exc, UnauthenticatedError):
        return 401
    if isinstance(exc, (PreconditionError, AlreadyExistsError)):
        return 412
    if isinstance(exc, GenericError):
        match = _STATUS.search(str(exc))
        return int(match.group(1)) if match else None
    return None


P = ParamSpec("P")
R = TypeVar("R")


def _typed_errors(call: Callable[P, R]) -> Callable[P, R]:
    """obstore's failures as the types the retry policy and the client's error mapping know:
    an HTTP error reply as ReplyError (its status), one without a reply (refused, reset,
    timed out, torn body) as ConnectionError, described in one line."""

    @functools.wraps(call)
    def typed(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return call(*args, **kwargs)
        except (BaseError, FileNotFoundError) as exc:
            status = _status_of(exc)
            if status is not None:
                text = " ".join(str(exc).split("Debug source:")[0].split())
                code, said = _xml_field(text, _XML_CODE), _xml_field(text, _XML_MESSAGE)
                if code:  # the S3 error reply, parsed (not its XML, cut mid-word)
                    text = f"{code} ({status})" + (f": {said}" if said else "")
                raise ReplyError(status, text[:300], code=code, detail=said) from exc
            if isinstance(exc, GenericError):
                raise ConnectionError(_describe_network_failure(exc)) from exc
            raise

    return typed


def _xml_field(text: str, pattern: re.Pattern[str]) -> str | None:
    """One field of an S3 error reply's XML body (None where the reply had no body)."""
    match = pattern.search(text)
    if match is None:
        return None
    return html.unescape(match.group(1)).strip() or None


def _describe_network_failure(exc: BaseException) -> str:
    """One line for a failure without an HTTP reply (obstore's own text ends in a dump of
    its Rust error chain)."""
    text = str(exc)
    kind, url = _HTTP_KIND.search(text), _URL.search(text)
    os_message = _OS_MESSAGE.search(text)
    what = _NETWORK.get(kind.group(1) if kind else "", "the request failed at")
    where = f" URL: {url.group(1)}" if url else ""
    return f"{what}{where}" + (f" ({os_message.group(1)})" if os_message else "")


@_typed_errors
def get(store: S3Store, key: str, start: int | None = None, end: int | None = None) -> Any:
    """The object, or its bytes ``start``..``end`` (end exclusive, None: to the end), as a
    buffer; a reply shorter than the range it claims to hold is a ShortBodyError."""
    if start is None and end is None:
        return obstore.get(store, key).bytes()
    lo = start or 0
    byte_range: Any = {"offset": lo} if end is None else (lo, end)
    result = obstore.get(store, key, options={"range": byte_range})
    body = result.bytes()
    got_lo, got_hi = result.range
    if got_lo != lo:  # a server that ignored the Range header: not the bytes asked for
        raise StoreError(f"get {key}: asked for bytes from {lo}, got from {got_lo}")
    if len(body) != got_hi - got_lo:  # torn, or a middlebox that cut it
        raise ShortBodyError(f"get {key}: {len(body)} bytes for the range {got_lo}-{got_hi}")
    return body


@_typed_errors
def head(store: S3Store, key: str) -> int:
    return int(obstore.head(store, key)["size"])


@_typed_errors
def list_prefix(store: S3Store, prefix: str) -> list[tuple[str, int]]:
    """(key, size) of every object whose key starts with ``prefix``. obstore lists whole
    path segments, so a prefix that ends inside a segment lists its directory, filtered."""
    directory = prefix[: prefix.rfind("/") + 1]
    found = []
    for batch in obstore.list(store, prefix=directory or None):
        found += [(o["path"], int(o["size"])) for o in batch if o["path"].startswith(prefix)]
    return found


@_typed_errors
def list_dirs(store: S3Store, prefix: str) -> list[str]:
    """The common prefixes one level below ``prefix`` (which ends in "/"), without it and
    without their trailing "/": one LIST per 1,000 names."""
    listed = obstore.list_with_delimiter(store, prefix=prefix.rstrip("/") or None)
    strip = len(prefix)
    return [p.rstrip("/")[strip:] for p in listed["common_prefixes"] if p.startswith(prefix)]


@_typed_errors
def reachable(store: S3Store, prefix: str) -> None:
    """Raises if the bucket cannot be listed (missing, denied, down): one delimiter listing
    of the store's top level (a few names: packs/, manifests/, ...), not a page of up to
    1,000 keys (252 KB at 512 nodes, on every command: bench/fleet.py)."""
    obstore.list_with_delimiter(store, prefix=prefix.rstrip("/") or None)


@_typed_errors
def holds_objects(store: S3Store, prefix: str) -> bool:
    """Whether any object is stored under ``prefix``: the first object of a listing (one
    request; not a delimiter listing, whose common prefixes SeaweedFS keeps for emptied
    "directories")."""
    first = next(iter(obstore.list(store, prefix=prefix.rstrip("/") or None, chunk_size=1)), [])
    return bool(first)
