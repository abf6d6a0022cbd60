"""Pick a backend from a store URL: a local path, ``file://PATH``, ``s3://bucket/prefix``, or
any other protocol fsspec knows (``memory://NAME``: an in-process store)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import ParseResult, unquote, urlparse

from transfer.endpoint import endpoint_from_env
from transfer.options import StoreSettings
from transfer.store.base import Store
from transfer.store.local import LocalStore
from transfer.store.retry import RetryPolicy


@dataclass(frozen=True)
class StoreOptions:
    """What opening a store takes beyond its URL: the S3 endpoint (credentials come from the
    standard AWS chain), the connection pool, and the StoreSettings every backend applies
    (the one retry policy is made from them here, for whichever backend the URL picks)."""

    endpoint_url: str | None = None
    pool_size: int = 32
    settings: StoreSettings = field(default_factory=StoreSettings)

    @classmethod
    def for_window(
        cls,
        window: int,
        *,
        endpoint_url: str | None = None,
        settings: StoreSettings | None = None,
    ) -> StoreOptions:
        """Options whose connection pool fits a transfer of ``window`` parts in flight, plus
        a few control calls (the CLI and the agent size it the same way)."""
        return cls(endpoint_url, max(window + 4, 16), settings or StoreSettings())

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(attempts=self.settings.attempts)


def open_store(url: str, options: StoreOptions | None = None) -> Store:
    options = options or StoreOptions()
    if not url.strip():
        # an unset $STORE: never turn the current directory into a store
        raise ValueError("the store URL is empty (is the variable that should hold it set?)")
    parsed = urlparse(url)
    if len(parsed.scheme) == 1 and os.name == "nt":  # C:\... is a path, not a scheme
        return _path_store(url, parsed, options)
    return SCHEMES.get(parsed.scheme, _fsspec_store)(url, parsed, options)


def _s3_store(url: str, parsed: ParseResult, options: StoreOptions) -> Store:
    if not parsed.netloc:
        raise ValueError(f"store URL {url!r} names no bucket (s3://bucket/prefix)")
    endpoint = _checked_endpoint(options.endpoint_url or endpoint_from_env()[0])
    # imported only for an s3:// URL: its clients take a while to import, more than a
    # whole pull of a small local checkpoint
    from transfer.store.s3 import S3Store
    from transfer.store.s3config import S3Settings

    settings = S3Settings(
        parsed.netloc,
        endpoint_url=endpoint,
        pool_size=options.pool_size,
        connect_timeout=options.settings.connect_timeout_seconds,
        read_timeout=options.settings.read_timeout_seconds,
    )
    return S3Store(
        settings, parsed.path, checksum=options.settings.checksum, retry=options.retry_policy()
    )


def _checked_endpoint(endpoint: str | None) -> str | None:
    """The S3 endpoint, refused in one line unless it is an http(s) URL with a host: the
    S3 clients below panic (obstore) or guess on anything else (``127.0.0.1:9000``)."""
    if not endpoint:
        return None
    try:
        parsed = urlparse(endpoint)
        ok = parsed.scheme in ("http", "https") and bool(parsed.hostname) and parsed.port != 0
    except ValueError:  # a port that is not a number, a bad IPv6 literal
        ok = False
    if not ok:
        hint = f" (did you mean http://{endpoint}?)" if "://" not in endpoint else ""
        raise ValueError(
            f"S3 endpoint {endpoint!r} is not an http(s) URL with a host{hint}; from "
            "--endpoint-url, the agent's endpoint_url, or AWS_ENDPOINT_URL(_S3)"
        )
    return endpoint


def local_root(url: str) -> Path | None:
    """The directory a local store URL names (a path, or file://), absolute; None for any
    other URL. A malformed one is the ValueError open_store raises for it."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return _file_root(url, parsed)
    return _path_root(url) if parsed.scheme == "" else None


def _file_store(url: str, parsed: ParseResult, options: StoreOptions) -> Store:
    return LocalStore(_file_root(url, parsed), options.retry_policy(), options.pool_size)


def _file_root(url: str, parsed: ParseResult) -> Path:
    if not parsed.netloc and not parsed.path:  # (file:// alone named the current directory)
        raise ValueError(f"file URL {url!r} names no path: file:///absolute/path")
    if parsed.netloc not in ("", "localhost"):
        # (file://../x, file://~/x: a relative path meant; file://server/x: a host)
        relative = parsed.netloc.startswith((".", "~"))
        alone = f", or the path alone ({parsed.netloc}{parsed.path})" if relative else ""
        raise ValueError(
            f"file URL {url!r} names a remote host ({parsed.netloc!r}): a local directory "
            f"is file:///absolute/path{alone}"
        )
    return Path(unquote(parsed.path)).absolute()


def _path_store(url: str, parsed: ParseResult, options: StoreOptions) -> Store:
    return LocalStore(_path_root(url), options.retry_policy(), options.pool_size)


def _path_root(url: str) -> Path:
    scheme, sep, _ = url.partition("//")
    if sep and scheme in _MISTYPED_SCHEMES:
        # ``s3//bucket/x`` (the colon lost) would quietly become a local directory
        raise ValueError(
            f"store URL {url!r} looks like a mistyped {scheme}:// URL; a local directory of "
            f"that name: ./{url}"
        )
    try:
        return Path(url).expanduser().absolute()
    except RuntimeError:  # ~nosuchuser/x: Python says only "Could not determine home directory"
        raise ValueError(f"store path {url!r}: no such user's home directory") from None


def _fsspec_store(url: str, parsed: ParseResult, options: StoreOptions) -> Store:
    """Any other scheme fsspec knows (``memory://``, or gcs/az/... with their package)."""
    scheme = parsed.scheme
    import fsspec  # only for these schemes

    from transfer.store.fsspecstore import FsspecStore

    if scheme not in fsspec.available_protocols():
        raise ValueError(
            f"unsupported store URL {url!r}: use a path, file://PATH, s3://bucket/prefix "
            "or another fsspec protocol (memory://NAME: within one process)"
        )
    try:
        cls = fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ValueError(f"store URL {url!r} needs a package fsspec names: {exc}") from None
    # ftp:// wants a host argument, zip:// a file to open: filesystems a URL alone does not
    # make (and a half-made one can complain again as it is collected: asked first)
    unopenable = ValueError(
        f"store URL {url!r}: fsspec's {scheme!r} filesystem cannot be opened from a URL "
        "alone; use a path, file://PATH or s3://bucket/prefix"
    )
    required = [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if required[1:]:  # (beyond self)
        raise unopenable
    try:
        fs = cls()
    except Exception as exc:  # fsspec's backends raise what they like
        raise ValueError(f"{unopenable} ({type(exc).__name__}: {exc})") from None
    root = fs._strip_protocol(url).rstrip("/")
    if not root.strip("/"):
        raise ValueError(f"store URL {url!r} names no path ({scheme}://NAME)")
    return FsspecStore(fs, root, url.rstrip("/"), options.retry_policy(), options.pool_size)


#: A store URL's scheme -> the backend that opens it (a plain path has none); any other
#: scheme goes to fsspec. Adding a backend: its module, and its line here.
SCHEMES: dict[str, Callable[[str, ParseResult, StoreOptions], Store]] = {
    "": _path_store,
    "file": _file_store,
    "s3": _s3_store,
}

#: A path that starts ``NAME//`` with one of these is a URL whose colon was lost.
_MISTYPED_SCHEMES = frozenset({*SCHEMES, "memory", "gs", "gcs", "az", "abfs"} - {""})
