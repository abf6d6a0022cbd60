"""Pick a backend from a store URL: a local path, ``file://PATH``, ``s3://bucket/prefix``, or
any other protocol fsspec knows (``memory://NAME``: an in-process store)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from transfer.store.base import Store
from transfer.store.local import LocalStore


@dataclass(frozen=True)
class StoreOptions:
    """Backend settings a user may set; S3 credentials come from the standard AWS chain."""

    endpoint_url: str | None = None
    pool_size: int = 32
    checksum: str = "crc32"


def open_store(url: str, options: StoreOptions | None = None) -> Store:
    options = options or StoreOptions()
    if not url.strip():
        # an unset $STORE: never turn the current directory into a store
        raise ValueError("the store URL is empty (is the variable that should hold it set?)")
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"store URL {url!r} names no bucket (s3://bucket/prefix)")
        endpoint = (
            options.endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        # imported only for an s3:// URL: s3fs and aiobotocore take ~0.4 s to import, more
        # than a whole pull of a small local checkpoint
        from transfer.store.s3 import S3Store

        return S3Store(
            parsed.netloc,
            parsed.path,
            endpoint_url=endpoint,
            pool_size=options.pool_size,
            checksum=options.checksum,
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL {url!r} names a remote host")
        return LocalStore(Path(unquote(parsed.path)).absolute())
    if parsed.scheme in ("",) or (len(parsed.scheme) == 1 and os.name == "nt"):
        return LocalStore(Path(url).expanduser().absolute())
    return _fsspec_store(url, parsed.scheme)


def _fsspec_store(url: str, scheme: str) -> Store:
    """Any other scheme fsspec knows (``memory://``, or gcs/az/... with their package)."""
    import fsspec  # only for these schemes

    from transfer.store.fsspecstore import FsspecStore

    if scheme not in fsspec.available_protocols():
        raise ValueError(
            f"unsupported store URL {url!r}: use a path, file://PATH, s3://bucket/prefix, "
            "memory://NAME or another fsspec protocol"
        )
    try:
        fs = fsspec.filesystem(scheme)
    except ImportError as exc:
        raise ValueError(f"store URL {url!r} needs a package fsspec names: {exc}") from None
    root = fs._strip_protocol(url).rstrip("/")
    if not root.strip("/"):
        raise ValueError(f"store URL {url!r} names no path ({scheme}://NAME)")
    return FsspecStore(fs, root, url.rstrip("/"))
